//! `message-producer`: pays an order and emits its event as a logical decoding
//! message, in one transaction (docs/messages.md). The logic lives in the library
//! (`src/lib.rs`); this is the CLI.
//!
//! ```text
//! psql -d app -v ON_ERROR_STOP=1 -f sql/outbox_messages.sql      # once, as a superuser
//! message-producer --postgres-url postgresql://postgres@127.0.0.1/app init --order-id 42
//! message-producer --postgres-url postgresql://app@127.0.0.1/app pay --order-id 42
//! ```

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Pay an order and emit its `order_paid` event through outbox_emit, in one
/// transaction; outbox-relay publishes it after the commit.
#[derive(Debug, Parser)]
#[command(name = "message-producer", version)]
struct Cli {
    /// Postgres URL or key=value conninfo of the application's database.
    #[arg(long, env = "PRODUCER_POSTGRES_URL", hide_env_values = true)]
    postgres_url: String,

    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Create the example's `orders` table if missing, and an open order.
    Init {
        #[arg(long)]
        order_id: i64,
        #[arg(long, default_value_t = 1999)]
        amount_cents: i64,
    },
    /// Mark an open order paid and emit `order_paid`; prints the event id.
    Pay {
        #[arg(long)]
        order_id: i64,
        /// A W3C trace context for the event's `traceparent` header.
        #[arg(long)]
        traceparent: Option<String>,
    },
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    let mut client = message_producer::connect(&cli.postgres_url).await?;
    match cli.command {
        Command::Init {
            order_id,
            amount_cents,
        } => {
            message_producer::init(&client, order_id, amount_cents).await?;
            println!("order {order_id}: open");
        }
        Command::Pay {
            order_id,
            traceparent,
        } => {
            let paid =
                message_producer::pay_order(&mut client, order_id, traceparent.as_deref()).await?;
            // One line on stdout for scripts: the id consumers will see as message_id.
            println!(
                "order {order_id}: paid {} cents, event {}",
                paid.amount_cents, paid.event_id
            );
        }
    }
    Ok(())
}
