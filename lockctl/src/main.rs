//! lockctl: the distlock command-line tool.
//!
//! - `demo`: the job-worker scenario, five strategies side by side;
//! - `check URL`: the conformance suite against a live store;
//! - `setup URL`: create the tables a store needs (PostgreSQL);
//! - `inspect`, `acquire`, `release`: one lock, by hand;
//! - `leader URL ROLE`: who leads a role elected with `distlock::Election`;
//! - `semaphore URL NAME --permits N`: who holds a semaphore's permits;
//!
//! A command on one store takes its URL first, or from `DISTLOCK_URL` when it is left
//! out (`lockctl inspect KEY`), as `distlock::connect_from_env` does.
//! - `bench URL…`: the capacity report's concurrency sweep against live stores;
//! - `torture URL`: fenced workers under pauses and kills against a live store, checked;
//! - `completions SHELL`: a completion script for bash, zsh, fish, elvish or PowerShell.

mod bench;
mod check;
mod demo;
mod exit;
mod features;
mod keys;
mod leader;
mod semaphore;
mod target;
mod torture;
mod used_keys;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand};

use target::{UrlAndName, url_or_env};

/// Distributed locks with fencing tokens: demo, conformance check and lock tools.
#[derive(Debug, Parser)]
#[command(name = "lockctl", version, propagate_version = true, after_help = exit::HELP)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Simulate job workers on an at-least-once queue and compare five strategies:
    /// no lock, lock, lock + renewal, + fencing, + idempotency key.
    Demo(DemoArgs),
    /// Run the conformance suite against a live store (under a random key prefix).
    Check {
        /// The store's URL, e.g. memory:// or redis://127.0.0.1:6379 (when left out, the
        /// URL in DISTLOCK_URL).
        url: Option<String>,
        /// Run only the cases whose name contains this.
        #[arg(long, default_value = "")]
        filter: String,
        /// Print one JSON object (every case's outcome, the counts, the cleanup) at the end.
        #[arg(long)]
        json: bool,
    },
    /// Create the schema and tables a store needs (PostgreSQL); idempotent.
    /// Other stores need nothing.
    Setup {
        /// The store's URL, e.g. postgres://user:password@host/db?schema=locks (when left
        /// out, the URL in DISTLOCK_URL).
        url: Option<String>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Show who holds a lock, its newest fencing token and the lease's remaining TTL.
    #[command(override_usage = "lockctl inspect [OPTIONS] [URL] <NAME>")]
    Inspect {
        #[command(flatten)]
        target: UrlAndName,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Take a lock and print its owner id and fencing token; the lease is not renewed.
    #[command(override_usage = "lockctl acquire [OPTIONS] [URL] <NAME>")]
    Acquire {
        #[command(flatten)]
        target: UrlAndName,
        /// The lease TTL, e.g. 30s, 1m, 500ms.
        #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
        ttl: Duration,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Release a lock taken by `acquire`, given its owner id and fencing token.
    #[command(
        override_usage = "lockctl release [OPTIONS] --owner <OWNER> --token <TOKEN> [URL] <NAME>"
    )]
    Release {
        #[command(flatten)]
        target: UrlAndName,
        /// The owner id printed by `acquire` (32 hex digits).
        #[arg(long)]
        owner: String,
        /// The fencing token printed by `acquire`.
        #[arg(long)]
        token: u64,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Show who leads a role elected with `distlock::Election`: the leader's owner id,
    /// fencing token and how long its lease still runs.
    /// The role's lock key is `election:NAME`.
    #[command(override_usage = "lockctl leader [OPTIONS] [URL] <NAME>")]
    Leader {
        #[command(flatten)]
        target: UrlAndName,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Show a semaphore's permits (from `Locker::semaphore`): each slot's holder, fencing
    /// token and how long its lease still runs. Its slots are the keys NAME:permit:0 to
    /// NAME:permit:N-1.
    #[command(override_usage = "lockctl semaphore [OPTIONS] --permits <N> [URL] <NAME>")]
    Semaphore {
        #[command(flatten)]
        target: UrlAndName,
        /// How many permits the semaphore has.
        #[arg(long)]
        permits: u32,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Measure acquire + release cycles per second and latency against live stores, at
    /// 1, 4, 16 and 64 concurrent tasks, and write report.md, capacity.csv and SVG charts.
    /// Works under a random key prefix and purges the keys it used.
    Bench {
        /// The stores' URLs, e.g. memory:// or redis://127.0.0.1:6379.
        #[arg(required = true)]
        urls: Vec<String>,
        /// Short measurements at 1 and 4 tasks only: checks a store answers.
        #[arg(long)]
        quick: bool,
        /// Where the report, CSV and charts go.
        #[arg(long, default_value = "lockctl-bench")]
        out: PathBuf,
        /// Print the rows as JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Run fenced critical sections in worker processes against a live store while a
    /// nemesis pauses them past the TTL and kills them, then check the history: token
    /// order, overlapping holders, stale writes admitted, lost updates, steps taken after
    /// a lease was lost. Works under a random name prefix and purges its locks.
    Torture(TortureArgs),
    /// One worker of `torture` (started by it).
    #[command(hide = true)]
    TortureWorker(torture::WorkerArgs),
    /// Print a completion script for a shell, e.g. `lockctl completions bash >
    /// /etc/bash_completion.d/lockctl`.
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
}

#[derive(Debug, Args)]
struct DemoArgs {
    /// The lock store's URL.
    #[arg(long, default_value = "memory://")]
    backend: String,
    /// The workload's seed: the same seed gives the same jobs and failures.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Workers per strategy.
    #[arg(long, default_value_t = 24)]
    workers: u32,
    /// Jobs in the workload.
    #[arg(long, default_value_t = 200)]
    jobs: u32,
    /// The lease TTL; every other duration of the scenario scales with it.
    #[arg(long, default_value = "300ms", value_parser = humantime::parse_duration)]
    ttl: Duration,
    /// Print the table as JSON: an array with one object per strategy.
    #[arg(long)]
    json: bool,
    /// Run the tenant-limit scenario instead: at most 2 exports per tenant at once, held
    /// by a semaphore under pauses and crashes, counted from the export ledger.
    #[arg(long)]
    tenants: bool,
}

#[derive(Debug, Args)]
struct TortureArgs {
    /// The store under test (when left out, the URL in DISTLOCK_URL, unless --own).
    url: Option<String>,
    /// Start the store itself instead (on a free loopback port, persisting to an
    /// append-only file), so that the nemesis also restarts it (SIGKILL, as a crash).
    #[arg(long, value_enum, conflicts_with = "url")]
    own: Option<torture::Own>,
    /// The redis-server binary --own redis starts.
    #[arg(long, default_value = "redis-server")]
    redis_server: String,
    /// How the store --own starts flushes its append-only file.
    #[arg(long, value_enum, default_value = "always")]
    fsync: torture::Fsync,
    /// The store that keeps the ledger the workers write (default: the store under test),
    /// e.g. a PostgreSQL URL whose schema `lockctl setup` made.
    #[arg(long)]
    ledger: Option<String>,
    /// Worker processes.
    #[arg(long, default_value_t = 4)]
    workers: u32,
    /// Locks the workers share (fewer locks, more contention).
    #[arg(long, default_value_t = 2)]
    keys: u32,
    /// How long the nemesis runs.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    duration: Duration,
    /// The lease TTL.
    #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
    ttl: Duration,
    /// Fenced writes per critical section.
    #[arg(long, default_value_t = 3)]
    steps: u32,
    /// The work between two writes.
    #[arg(long, default_value = "20ms", value_parser = humantime::parse_duration)]
    step_time: Duration,
    /// The mean time between two nemesis actions (a pause or a kill).
    #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
    nemesis_every: Duration,
    /// No nemesis: workers only contend.
    #[arg(long)]
    calm: bool,
    /// The nemesis never pauses workers.
    #[arg(long)]
    no_pauses: bool,
    /// The nemesis never kills workers.
    #[arg(long)]
    no_kills: bool,
    /// The seed of the workers' and the nemesis's choices.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
    /// Put a bug into the workers' store client, to see the checker catch it.
    #[arg(long, value_enum, hide = true)]
    r#break: Option<torture::Break>,
}

fn main() -> ExitCode {
    let matches = Cli::command()
        .mut_subcommands(|command| command.after_help(exit::HELP))
        .get_matches();
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    let command = match cli.command.resolve(|name| std::env::var(name).ok()) {
        Ok(command) => command,
        Err(message) => {
            eprintln!("lockctl: {message}");
            return exit::wrong();
        }
    };
    if let Err(message) = features::check(&command.urls()) {
        eprintln!("lockctl: {message}");
        return exit::wrong();
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("lockctl: cannot start the async runtime: {e}");
            return ExitCode::from(4);
        }
    };
    match runtime.block_on(run(command)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("lockctl: {e}");
            exit::of(&e)
        }
    }
}

/// A command with its store URLs resolved (`DISTLOCK_URL` read where the URL was left out).
#[derive(Debug)]
enum Resolved {
    Demo(DemoArgs),
    Check {
        url: String,
        filter: String,
        json: bool,
    },
    Setup {
        url: String,
        json: bool,
    },
    Inspect {
        url: String,
        key: String,
        json: bool,
    },
    Acquire {
        url: String,
        key: String,
        ttl: Duration,
        json: bool,
    },
    Release {
        url: String,
        key: String,
        owner: String,
        token: u64,
        json: bool,
    },
    Leader {
        url: String,
        role: String,
        json: bool,
    },
    Semaphore {
        url: String,
        name: String,
        permits: u32,
        json: bool,
    },
    Bench {
        urls: Vec<String>,
        quick: bool,
        out: PathBuf,
        json: bool,
    },
    Completions {
        shell: clap_complete::Shell,
    },
    Torture(torture::Options),
    TortureWorker(torture::WorkerArgs),
}

impl Command {
    /// The command with its URLs, or what is missing.
    fn resolve(self, env: impl Fn(&str) -> Option<String>) -> Result<Resolved, String> {
        Ok(match self {
            Command::Demo(args) => Resolved::Demo(args),
            Command::Check { url, filter, json } => Resolved::Check {
                url: url_or_env(url, env)?,
                filter,
                json,
            },
            Command::Setup { url, json } => Resolved::Setup {
                url: url_or_env(url, env)?,
                json,
            },
            Command::Inspect { target, json } => {
                let (url, key) = target.resolve(env)?;
                Resolved::Inspect { url, key, json }
            }
            Command::Acquire { target, ttl, json } => {
                let (url, key) = target.resolve(env)?;
                Resolved::Acquire {
                    url,
                    key,
                    ttl,
                    json,
                }
            }
            Command::Release {
                target,
                owner,
                token,
                json,
            } => {
                let (url, key) = target.resolve(env)?;
                Resolved::Release {
                    url,
                    key,
                    owner,
                    token,
                    json,
                }
            }
            Command::Leader { target, json } => {
                let (url, role) = target.resolve(env)?;
                Resolved::Leader { url, role, json }
            }
            Command::Semaphore {
                target,
                permits,
                json,
            } => {
                let (url, name) = target.resolve(env)?;
                Resolved::Semaphore {
                    url,
                    name,
                    permits,
                    json,
                }
            }
            Command::Bench {
                urls,
                quick,
                out,
                json,
            } => Resolved::Bench {
                urls,
                quick,
                out,
                json,
            },
            Command::Completions { shell } => Resolved::Completions { shell },
            Command::Torture(args) => Resolved::Torture(torture::Options {
                target: match args.own {
                    Some(own) => torture::Target::Own(own, args.redis_server, args.fsync),
                    None => torture::Target::Url(url_or_env(args.url, env)?),
                },
                ledger: args.ledger,
                workers: args.workers,
                keys: args.keys,
                duration: args.duration,
                ttl: args.ttl,
                steps: args.steps,
                step_time: args.step_time,
                nemesis_every: {
                    let idle = args.calm || (args.no_pauses && args.no_kills);
                    (!idle).then_some(args.nemesis_every)
                },
                pauses: !args.no_pauses,
                kills: !args.no_kills,
                seed: args.seed,
                json: args.json,
                r#break: args.r#break,
            }),
            Command::TortureWorker(args) => Resolved::TortureWorker(args),
        })
    }
}

impl Resolved {
    /// The store URLs the command will open.
    fn urls(&self) -> Vec<&str> {
        match self {
            Resolved::Demo(args) => vec![args.backend.as_str()],
            Resolved::Check { url, .. }
            | Resolved::Setup { url, .. }
            | Resolved::Inspect { url, .. }
            | Resolved::Acquire { url, .. }
            | Resolved::Release { url, .. }
            | Resolved::Leader { url, .. }
            | Resolved::Semaphore { url, .. } => vec![url.as_str()],
            Resolved::Bench { urls, .. } => urls.iter().map(String::as_str).collect(),
            Resolved::Torture(options) => {
                let url = match &options.target {
                    torture::Target::Url(url) => url.as_str(),
                    torture::Target::Own(torture::Own::Redis, ..) => "redis://",
                };
                [Some(url), options.ledger.as_deref()]
                    .into_iter()
                    .flatten()
                    .collect()
            }
            Resolved::TortureWorker(args) => vec![args.url.as_str(), args.ledger.as_str()],
            Resolved::Completions { .. } => Vec::new(),
        }
    }
}

async fn run(command: Resolved) -> Result<ExitCode, distlock::LockError> {
    match command {
        Resolved::Demo(args) => {
            let options = demo::Options {
                backend: args.backend,
                seed: args.seed,
                workers: args.workers,
                jobs: args.jobs,
                ttl: args.ttl,
                json: args.json,
                tenants: args.tenants,
            };
            println!("{}", demo::run(&options).await?);
            Ok(ExitCode::SUCCESS)
        }
        Resolved::Check { url, filter, json } => check::run(&url, &filter, json).await,
        Resolved::Setup { url, json } => keys::setup(&url, json).await,
        Resolved::Inspect { url, key, json } => keys::inspect(&url, &key, json).await,
        Resolved::Acquire {
            url,
            key,
            ttl,
            json,
        } => keys::acquire(&url, &key, ttl, json).await,
        Resolved::Release {
            url,
            key,
            owner,
            token,
            json,
        } => keys::release(&url, &key, &owner, token, json).await,
        Resolved::Leader { url, role, json } => leader::show(&url, &role, json).await,
        Resolved::Semaphore {
            url,
            name,
            permits,
            json,
        } => semaphore::show(&url, &name, permits, json).await,
        Resolved::Completions { shell } => {
            clap_complete::generate(
                shell,
                &mut Cli::command(),
                "lockctl",
                &mut std::io::stdout(),
            );
            Ok(ExitCode::SUCCESS)
        }
        Resolved::Torture(options) => torture::run(&options).await,
        Resolved::TortureWorker(args) => torture::worker::run(&args)
            .await
            .map(|()| ExitCode::SUCCESS),
        Resolved::Bench {
            urls,
            quick,
            out,
            json,
        } => Ok(bench::run(&bench::Options {
            urls: &urls,
            quick,
            out: &out,
            json,
        })
        .await),
    }
}
