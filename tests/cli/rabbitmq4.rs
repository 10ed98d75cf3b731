//! `check` names what RabbitMQ 4 refuses or changes by default, with the fix (issue 51,
//! item 4; docs/operations.md, "RabbitMQ 4"), against whichever broker of the matrix
//! the run has (scripts/test.sh runs this module against 3.10 and against 4.x):
//! from `[topology]` on both, and with the management API the broker's own view:
//! mirroring policies (3.10 accepts them; 4.x refuses to create one, which the test
//! asserts) and the deprecated features in use (4.x reports them; 3.10 has no such
//! API, and `check` says so). Every queue and policy is the test's own.
#![allow(clippy::unwrap_used)]

use lapin::options::QueueDeleteOptions;
use support::*;
use testkit::unique_name;

/// The `warn` line about `name`, if any.
fn warn_of<'a>(out: &'a str, name: &str) -> Option<&'a str> {
    out.lines()
        .find(|l| l.starts_with("warn") && l[6..].starts_with(&format!("{name}: ")))
}

/// A policy of the test's own on the `/` vhost, cleared on drop.
struct Policy(String);

impl Policy {
    /// `rabbitmqctl set_policy`; the broker's refusal as Err.
    fn set(name: &str, pattern: &str, definition: &str) -> Result<Policy, String> {
        let out = testkit::rabbitmqctl_command()
            .args([
                "-q",
                "set_policy",
                "--apply-to",
                "queues",
                name,
                pattern,
                definition,
            ])
            .output()
            .unwrap();
        match out.status.success() {
            true => Ok(Policy(name.to_string())),
            false => Err(output_text(&out)),
        }
    }
}

impl Drop for Policy {
    fn drop(&mut self) {
        let _ = testkit::rabbitmqctl_command()
            .args(["-q", "clear_policy", &self.0])
            .output();
    }
}

/// `[topology]` with one queue per hazard and a quorum queue with a DLX (`q`, in that
/// order: transient, master locator, quorum, quorum for a policy's DLX, quorum with DLX).
fn topology(q: &[&str; 5], exchange: &str) -> String {
    format!(
        r#"
[[topology.queue]]
name = "{}"
durable = false

[[topology.queue]]
name = "{}"
arguments = {{ x-queue-master-locator = "client-local" }}

[[topology.queue]]
name = "{}"
type = "quorum"

[[topology.queue]]
name = "{}"
type = "quorum"

[[topology.queue]]
name = "{}"
type = "quorum"
arguments = {{ x-dead-letter-exchange = "{exchange}" }}
"#,
        q[0],
        q[1],
        q[2],
        q[3],
        q[4],
        exchange = exchange
    )
}

/// `check` with the management API, again until the broker applied the test's policy
/// to `by_policy` (it does so asynchronously).
async fn check_with_management(env: &Env, by_policy: &str) -> String {
    let mut out = String::new();
    for _ in 0..50 {
        let url = management_url();
        out = output_text(&env.cli_env(
            &["check"],
            &[("OUTBOX_RELAY_RABBITMQ_MANAGEMENT_URL", &url)],
        ));
        if warn_of(&out, &format!("queue {by_policy}")).is_none() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_names_each_rabbitmq_4_hazard_with_its_fix() {
    let _shared = testkit::BROKER.read().await;
    let mut env = Env::new().await;
    let scratch = unique_name("r4_scratch");
    let located = unique_name("r4_located");
    let no_dlx = unique_name("r4_nodlx");
    let by_policy = unique_name("r4_policy_dlx");
    let with_dlx = unique_name("r4_dlx");
    env.extra = topology(
        &[&scratch, &located, &no_dlx, &by_policy, &with_dlx],
        &env.exchange,
    );
    env.create_slot();

    // [topology] alone, without the management API.
    let out = output_text(&env.cli(&["check"]));
    let scratch_line = warn_of(&out, &format!("queue {scratch}")).expect(&out);
    assert!(
        scratch_line.contains("transient non-exclusive") && scratch_line.contains("durable = true"),
        "{out}"
    );
    let located_line = warn_of(&out, &format!("queue {located}")).expect(&out);
    assert!(located_line.contains("x-queue-leader-locator"), "{out}");
    for q in [&no_dlx, &by_policy] {
        let l = warn_of(&out, &format!("queue {q}")).expect(&out);
        assert!(
            l.contains("delivery limit is 20") && l.contains("x-dead-letter-exchange"),
            "{out}"
        );
    }
    assert!(
        warn_of(&out, &format!("queue {with_dlx}")).is_none(),
        "{out}"
    );
    let summary = out
        .lines()
        .find(|l| l.starts_with("ok    rabbitmq 4: "))
        .expect(&out);
    assert!(
        summary.contains("4 hazard(s)") && summary.contains("management_url"),
        "{out}"
    );

    // Declared on the broker (the transient queue is then a deprecated feature in use
    // on 4.x), and a policy that gives one quorum queue a dead-letter exchange.
    let declared = env.cli(&["check", "--declare"]);
    assert!(declared.status.success(), "{}", output_text(&declared));
    let dlx_policy = Policy::set(
        &unique_name("r4_dlxpol"),
        &format!("^{by_policy}$"),
        &format!("{{\"dead-letter-exchange\": \"{}\"}}", env.exchange),
    )
    .unwrap();
    let mirror_name = unique_name("r4_ha");
    let mirroring = Policy::set(
        &mirror_name,
        &format!("^{mirror_name}$"),
        "{\"ha-mode\": \"all\"}",
    );
    let major = testkit::broker_major();
    match (&mirroring, major) {
        (Ok(_), 3) | (Err(_), 4) => {}
        (m, _) => panic!(
            "RabbitMQ {major} answered set_policy ha-mode with {:?}",
            m.as_ref().map(|p| &p.0)
        ),
    }
    let out = check_with_management(&env, &by_policy).await;
    assert!(
        warn_of(&out, &format!("queue {by_policy}")).is_none(),
        "the policy's DLX is not seen:\n{out}"
    );
    assert!(warn_of(&out, &format!("queue {no_dlx}")).is_some(), "{out}");
    let summary = out
        .lines()
        .find(|l| l.starts_with("ok    rabbitmq 4: "))
        .expect(&out);
    match major {
        3 => {
            let ha = warn_of(&out, &format!("policy {mirror_name}")).expect(&out);
            assert!(
                ha.contains("classic mirroring") && ha.contains("quorum"),
                "{out}"
            );
            assert!(
                summary.contains("RabbitMQ 3.")
                    && summary.contains("does not report deprecated features"),
                "{out}"
            );
        }
        _ => {
            let used = warn_of(&out, "deprecated feature transient_nonexcl_queues").expect(&out);
            assert!(used.contains("in use on the broker"), "{out}");
            assert!(
                summary.contains("RabbitMQ 4.")
                    && summary.contains("the deprecated features in use"),
                "{out}"
            );
        }
    }
    drop((dlx_policy, mirroring));
    for q in [&scratch, &located, &no_dlx, &by_policy, &with_dlx] {
        let _ = env
            .broker
            .channel
            .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
            .await;
    }
    env.cleanup().await;
}
