//! The network namespaces the cluster tests make (`tests/common/nodes.rs`)
//! when a run before was killed mid-test and left its own behind: they are
//! removed first, so their routes do not capture this run's addresses.

mod common;
#[path = "common/nodes.rs"]
mod nodes;

use nodes::Netns;

/// The device `ip route get` says a packet to `addr` leaves by.
fn route_dev(addr: &str) -> String {
    let out = nodes::ip_output(&["-o", "route", "get", addr]).expect("ip route get");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.split_whitespace()
        .skip_while(|w| *w != "dev")
        .nth(1)
        .unwrap_or_default()
        .to_string()
}

fn exists(args: &[&str], name: &str) -> bool {
    let out = nodes::ip_output(args).expect("ip");
    String::from_utf8_lossy(&out.stdout).contains(name)
}

#[test]
fn namespaces_a_killed_run_left_behind_are_removed_before_new_ones() {
    // A killed run's two namespaces: made as every run makes them, then
    // left in place without their Drop, under a tag that is not this
    // process's (whose names the new set takes).
    let tag = (std::process::id() % 100_000 + 1) % 100_000;
    let Some(stale) = Netns::create_tagged(2, tag) else {
        return;
    };
    let stale_hosts = [stale.host_end(0), stale.host_end(1)];
    // Checked while the lock is still held: once it is released, another
    // test binary waiting for it may clean them up first.
    assert!(exists(&["netns", "list"], &stale.names[1]));
    assert_eq!(route_dev("10.77.1.2"), stale_hosts[1]);
    let stale_names = stale.abandon();

    let ns = Netns::create(2).expect("namespaces were made a moment ago");
    for (name, host) in stale_names.iter().zip(&stale_hosts) {
        assert!(!exists(&["netns", "list"], name), "{name} is still there");
        assert!(
            !exists(&["-o", "link", "show"], host),
            "{host} is still there"
        );
    }
    // This run's routes are its own.
    assert_eq!(route_dev("10.77.0.2"), ns.host_end(0));
    assert_eq!(route_dev("10.77.1.2"), ns.host_end(1));
    let ok = nodes::ip_output(&["netns", "exec", &ns.names[1], "ip", "-o", "addr", "show"])
        .expect("ip netns exec");
    assert!(String::from_utf8_lossy(&ok.stdout).contains("10.77.1.2/24"));
}
