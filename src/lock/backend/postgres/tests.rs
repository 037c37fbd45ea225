//! The PostgreSQL backend's own tests that need no server: what its parsing refuses, its
//! reconnection schedule, its estimate of the server's clock. Those on a real server are the
//! kit's (`testkit/postgres/backend.rs`), beside the server they start.

use std::time::Duration;

use super::listener::{channel, parse_payload};
use super::schema::key_lock;
use super::target::has_unescaped_at;
use super::*;

#[test]
fn an_at_sign_left_in_a_urls_user_information_is_found() {
    assert!(has_unescaped_at("postgres://u:p@ss@host/db"));
    assert!(has_unescaped_at("postgresql://u@x:p@host"));
    assert!(!has_unescaped_at("postgres://u:p%40ss@host/db"));
    assert!(!has_unescaped_at(
        "postgres://u@host/db?application_name=a@b"
    ));
    assert!(!has_unescaped_at("postgres://host/db#x@y@z"));
    // The key-value form names the password on its own.
    assert!(!has_unescaped_at("host=h user=u password=p@ss@word"));
}

#[test]
fn reconnects_back_off_on_the_busy_schedule_and_start_over_after_a_success_or_its_end() {
    let minute = Duration::from_secs(60);
    let backoff = Schedule::spaced(minute).intersect(Schedule::recurs(1));
    let mut reconnect = Reconnect::new(backoff);
    assert_eq!(reconnect.wait_left(), None, "the first attempt at once");
    reconnect.failed();
    let left = reconnect.wait_left().expect("a failure waits");
    assert!(left > minute - Duration::from_secs(1) && left <= minute);
    reconnect.failed();
    assert!(
        reconnect.wait_left().is_some(),
        "the schedule's end starts it over: the manager never gives up"
    );
    reconnect.succeeded();
    assert_eq!(reconnect.wait_left(), None);
}

#[test]
fn channels_fit_in_an_identifier_whatever_the_schema() {
    assert_eq!(channel("leasehold"), "leasehold_leasehold");
    let long = "s".repeat(63);
    assert!(channel(&long).len() <= 63);
    assert_ne!(channel(&long), channel(&"t".repeat(63)));
    assert_eq!(channel(&long), channel(&long));
}

#[test]
fn announcements_name_their_keys_or_say_that_something_changed() {
    let keys = [
        key_hash("a"),
        key_hash("b,c"),
        key_hash(&"x".repeat(10_000)),
    ];
    assert_eq!(parse_payload(&payload(&keys)), Some(keys.to_vec()));
    assert_eq!(parse_payload(""), Some(Vec::new()));
    let many: Vec<i64> = (0..2_000).collect();
    assert_eq!(payload(&many), "*");
    assert_eq!(parse_payload("*"), None);
}

#[test]
fn key_locks_depend_on_the_schema_and_the_key() {
    assert_eq!(key_lock("s", "k"), key_lock("s", "k"));
    assert_ne!(key_lock("s", "k"), key_lock("t", "k"));
    assert_ne!(key_lock("s", "k"), key_lock("s", "j"));
}

#[test]
fn schema_names_that_could_inject_sql_are_refused() {
    assert!(valid_schema("leasehold"));
    assert!(valid_schema("app_locks_2"));
    for bad in [
        "",
        "Leasehold",
        "a b",
        "x\"; DROP TABLE t; --",
        "1abc",
        &"a".repeat(64),
    ] {
        assert!(!valid_schema(bad), "{bad:?}");
    }
    assert_eq!(quote("a\"b"), "\"a\"\"b\"");
}

#[test]
fn a_password_never_appears_in_the_description() {
    let target = parse("postgres://alice:s3cret@db.example/app?sslmode=disable").unwrap();
    let config = &target.config;
    let text = format!("{} {config:?}", describe(config));
    assert!(!text.contains("s3cret"), "{text}");
    let target = parse("host=/run/postgresql user=alice password=s3cret dbname=app").unwrap();
    let config = &target.config;
    let text = format!("{} {config:?}", describe(config));
    assert!(!text.contains("s3cret"), "{text}");
    let Err(error) = parse("postgres://alice:s3cret@db.example:notaport/app") else {
        panic!("a port that is not a number was accepted");
    };
    assert!(!error.to_string().contains("s3cret"), "{error}");
}

/// The bounds on the store's time less this process's (`Steps`): a call on time is never
/// refused, a step within `STEP_BOUND` is none, a step beyond it is found with at least its
/// size (and not much more), a backward step starts the bounds over, and they widen with time.
#[test]
fn steps_find_a_forward_step_beyond_the_bound_and_nothing_within_it() {
    let mut steps = Steps::default();
    assert_eq!(steps.latest(0), None, "nothing known yet");
    // The store's time runs a second ahead of this process's; round trips of a millisecond.
    let ahead = 1_000_000;
    steps.observed(ahead + 10_500, 10_000, 11_000);
    let latest = steps.latest(20_000).unwrap();
    assert!(latest >= 20_000 + ahead + STEP_BOUND, "{latest}");
    assert_eq!(steps.step(ahead + 30_500, 30_000, 31_000), None);
    assert_eq!(
        steps.step(ahead + 30_500 + STEP_BOUND / 2, 30_000, 31_000),
        None
    );
    let hour = 3_600_000_000;
    let found = steps.step(ahead + 30_500 + hour, 30_000, 31_000).unwrap();
    assert!((hour..=hour + 2_000).contains(&found), "{found}");
    // Stepped back five seconds: the bounds start over from there.
    steps.observed(ahead - 5_000_000 + 40_500, 40_000, 41_000);
    assert!(
        steps.latest(50_000).unwrap() < 50_000 + ahead,
        "judged by the old bounds"
    );
    // A minute later, the bounds are a millisecond a second wider (drift).
    let later = steps.latest(41_000 + 60_000_000).unwrap();
    let now = steps.latest(41_000).unwrap();
    assert_eq!(later - now, 60_000_000 + 60_000);
}
