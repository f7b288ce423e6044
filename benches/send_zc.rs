//! `IORING_OP_SEND` against `IORING_OP_SEND_ZC` for the node's large
//! frames (issue 32, part 3): the same bytes over one TCP connection, the
//! sends issued from an io_uring as the node's pollers issue theirs, a
//! plain `read(2)` loop receiving. Copy mode sends from ordinary memory
//! (the kernel copies each byte into socket buffers); zero-copy mode sends
//! from a registered buffer, and a buffer is reused only after its
//! notification (`IORING_CQE_F_NOTIF`: the kernel let go of its pages,
//! for TCP once the peer acknowledged them).
//!
//! Rounds alternate the two modes, each on a fresh connection; it prints
//! each round, the medians, and the paired ratios (zero-copy over copy,
//! round by round) of throughput and of the sender's CPU per GB.
//!
//! ```text
//! cargo bench --bench send_zc                       # over loopback, receiver in-process
//! cargo bench --bench send_zc -- --receive 0.0.0.0:7000          # on the receiving machine
//! cargo bench --bench send_zc -- --connect HOST:7000 --rounds 5  # on the sending one
//! ```
//!
//! Options: `--send-bytes N` (bytes per send, default 262144: the node's
//! default chunk), `--depth N` (sends in flight, default 4),
//! `--total-bytes N` (per round, default 2 GiB), `--rounds N` (per mode,
//! default 5).
//!
//! Over loopback (or a veth pair between namespaces) the receiving side
//! copies the pages of a zero-copy send anyway (the kernel's
//! `skb_orphan_frags_rx`: a local receiver must not see pages the sender
//! may still change), so there zero-copy pays its notifications and page
//! pinning without saving the copy; the saving it is for needs a real NIC
//! (`--receive` on another machine).

use std::io::Read;
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use io_uring::{cqueue, opcode, types, IoUring};

struct Opts {
    send_bytes: usize,
    depth: usize,
    total_bytes: u64,
    rounds: usize,
    connect: Option<String>,
    receive: Option<String>,
}

fn parse() -> Opts {
    let mut o = Opts {
        send_bytes: 256 << 10,
        depth: 4,
        total_bytes: 2 << 30,
        rounds: 5,
        connect: None,
        receive: None,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || args.next().unwrap_or_else(|| panic!("{a} needs a value"));
        match a.as_str() {
            "--send-bytes" => o.send_bytes = val().parse().expect("--send-bytes N"),
            "--depth" => o.depth = val().parse().expect("--depth N"),
            "--total-bytes" => o.total_bytes = val().parse().expect("--total-bytes N"),
            "--rounds" => o.rounds = val().parse().expect("--rounds N"),
            "--connect" => o.connect = Some(val()),
            "--receive" => o.receive = Some(val()),
            // `cargo bench` passes this to every bench target.
            "--bench" => {}
            other => panic!("unknown argument {other} (see the top of benches/send_zc.rs)"),
        }
    }
    assert!(o.depth > 0 && o.depth <= 64, "--depth 1 to 64");
    assert!(
        o.send_bytes > 0 && o.send_bytes <= 64 << 20,
        "--send-bytes up to 64 MiB"
    );
    o
}

/// CPU seconds (user + system) of `who` (`RUSAGE_SELF`: every thread of
/// the process, the kernel's io_uring workers for it included;
/// `RUSAGE_THREAD`: the calling thread).
fn cpu_s(who: libc::c_int) -> f64 {
    // SAFETY: rusage is plain integers (timevals and longs), for which
    // all zero bytes is a valid value; getrusage then fills it.
    let mut r: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `r` is a live, writable rusage for the call's duration.
    assert_eq!(unsafe { libc::getrusage(who, &mut r) }, 0);
    let t = |v: libc::timeval| v.tv_sec as f64 + v.tv_usec as f64 / 1e6;
    t(r.ru_utime) + t(r.ru_stime)
}

/// Reads until EOF; (bytes, this thread's CPU seconds).
fn receive(mut s: TcpStream) -> (u64, f64) {
    let c0 = cpu_s(libc::RUSAGE_THREAD);
    let mut buf = vec![0u8; 1 << 20];
    let mut n = 0u64;
    loop {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(k) => n += k as u64,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => panic!("receiving: {e}"),
        }
    }
    (n, cpu_s(libc::RUSAGE_THREAD) - c0)
}

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Copy,
    ZeroCopy,
}

/// One round: `total` bytes in sends of `send_bytes`, `depth` in flight.
/// Returns the seconds it took (until the last send completed and, for
/// zero-copy, its buffer was released).
fn send(s: &TcpStream, mode: Mode, o: &Opts, buf: &mut [u8]) -> f64 {
    let fd = types::Fd(s.as_raw_fd());
    let mut ring = IoUring::new(2 * o.depth as u32 + 2).expect("io_uring");
    if mode == Mode::ZeroCopy {
        let iov = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        // SAFETY: the buffer outlives the ring (dropped at the end of this
        // function, before `buf`'s owner).
        unsafe { ring.submitter().register_buffers(&[iov]) }.expect("register the buffer");
    }
    // Per slot: whether a send from it is in flight, and (zero-copy)
    // whether its notification is still to come.
    let mut busy = vec![false; o.depth];
    let mut notif = vec![false; o.depth];
    let (mut issued, mut done) = (0u64, 0u64);
    let t0 = Instant::now();
    while done < o.total_bytes || busy.iter().any(|&b| b) || notif.iter().any(|&b| b) {
        for slot in 0..o.depth {
            if busy[slot] || notif[slot] || issued >= o.total_bytes {
                continue;
            }
            let len = (o.total_bytes - issued).min(o.send_bytes as u64) as u32;
            let ptr = buf[slot * o.send_bytes..].as_ptr();
            let sqe = match mode {
                Mode::Copy => opcode::Send::new(fd, ptr, len)
                    .flags(libc::MSG_WAITALL)
                    .build(),
                Mode::ZeroCopy => opcode::SendZc::new(fd, ptr, len)
                    .buf_index(Some(0))
                    .flags(libc::MSG_WAITALL)
                    .build(),
            }
            .user_data(slot as u64);
            // SAFETY: the slot's bytes stay untouched until its completion
            // (and, zero-copy, its notification) is reaped below.
            unsafe { ring.submission().push(&sqe) }.expect("room for depth sends");
            busy[slot] = true;
            issued += len as u64;
        }
        ring.submit_and_wait(1).expect("io_uring_enter");
        for cqe in ring.completion() {
            let slot = cqe.user_data() as usize;
            if cqueue::notif(cqe.flags()) {
                notif[slot] = false;
                continue;
            }
            let res = cqe.result();
            assert!(
                res > 0,
                "send failed: {}",
                std::io::Error::from_raw_os_error(-res)
            );
            done += res as u64;
            busy[slot] = false;
            // A notification follows when F_MORE is set.
            notif[slot] = cqueue::more(cqe.flags());
        }
    }
    assert_eq!(done, o.total_bytes, "every byte sent whole (MSG_WAITALL)");
    t0.elapsed().as_secs_f64()
}

struct Round {
    gb_per_s: f64,
    cpu_s_per_gb: f64,
}

fn round(mode: Mode, o: &Opts, buf: &mut [u8]) -> Round {
    let (s, receiver) = match &o.connect {
        Some(addr) => (TcpStream::connect(addr).expect("connect"), None),
        None => {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            let addr = l.local_addr().unwrap();
            let h = std::thread::spawn(move || receive(l.accept().unwrap().0));
            (TcpStream::connect(addr).unwrap(), Some(h))
        }
    };
    let cpu0 = cpu_s(libc::RUSAGE_SELF);
    let secs = send(&s, mode, o, buf);
    drop(s);
    let recv_cpu = match receiver {
        Some(h) => {
            let (n, cpu) = h.join().unwrap();
            assert_eq!(n, o.total_bytes, "the receiver got every byte");
            cpu
        }
        None => 0.0,
    };
    // The sender's share: the process's CPU less the receiving thread's.
    let sender_cpu = cpu_s(libc::RUSAGE_SELF) - cpu0 - recv_cpu;
    let gb = o.total_bytes as f64 / 1e9;
    Round {
        gb_per_s: gb / secs,
        cpu_s_per_gb: sender_cpu / gb,
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let o = parse();
    if let Some(addr) = &o.receive {
        let l = TcpListener::bind(addr).expect("bind");
        println!("receiving on {}", l.local_addr().unwrap());
        for s in l.incoming() {
            let t0 = Instant::now();
            let (n, cpu) = receive(s.expect("accept"));
            let secs = t0.elapsed().as_secs_f64().max(1e-9);
            println!(
                "{n} bytes in {secs:.2} s: {:.2} GB/s, {cpu:.2} CPU s",
                n as f64 / 1e9 / secs
            );
        }
        return;
    }
    let mut buf = vec![0x5au8; o.depth * o.send_bytes];
    println!(
        "send_zc: {} rounds per mode of {} bytes, sends of {} bytes, {} in flight, to {}",
        o.rounds,
        o.total_bytes,
        o.send_bytes,
        o.depth,
        o.connect
            .as_deref()
            .unwrap_or("loopback (receiver in this process)")
    );
    let (mut copy, mut zc) = (Vec::new(), Vec::new());
    for r in 0..o.rounds {
        // Alternate which goes first, so a drift in the machine's load
        // does not favour one mode.
        let order = if r % 2 == 0 {
            [Mode::Copy, Mode::ZeroCopy]
        } else {
            [Mode::ZeroCopy, Mode::Copy]
        };
        for m in order {
            let x = round(m, &o, &mut buf);
            println!(
                "round {r} {:>9}: {:.2} GB/s, {:.3} sender CPU s per GB",
                if m == Mode::Copy { "send" } else { "send_zc" },
                x.gb_per_s,
                x.cpu_s_per_gb
            );
            if m == Mode::Copy { &mut copy } else { &mut zc }.push(x);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let med = |v: &[Round], f: fn(&Round) -> f64| median(v.iter().map(f).collect());
    let paired =
        |f: fn(&Round) -> f64| median(zc.iter().zip(&copy).map(|(z, c)| f(z) / f(c)).collect());
    println!("| mode | GB/s, median | sender CPU s per GB, median |");
    println!("|---|---:|---:|");
    for (name, v) in [("IORING_OP_SEND", &copy), ("IORING_OP_SEND_ZC", &zc)] {
        println!(
            "| {name} | {:.2} | {:.3} |",
            med(v, |r| r.gb_per_s),
            med(v, |r| r.cpu_s_per_gb)
        );
    }
    println!(
        "send_zc / send, paired by round: throughput {:.2}x, sender CPU per GB {:.2}x",
        paired(|r| r.gb_per_s),
        paired(|r| r.cpu_s_per_gb)
    );
}
