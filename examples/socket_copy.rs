//! The reference for the network benchmark: the fastest plain TCP copy
//! between two processes, to compare kspeed's push protocol with.
//!
//! ```text
//! cargo run --release --example socket_copy -- recv 127.0.0.1:7500 BYTES &
//! cargo run --release --example socket_copy -- send 127.0.0.1:7500 BYTES [SOURCE_BYTES]
//! ```
//!
//! The sender writes BYTES from a 1 MiB buffer with `write_all` (a buffer
//! that stays in the CPU's cache), or, with SOURCE_BYTES, 1 MiB at a time
//! from a SOURCE_BYTES buffer it walks like a ring (a dataset in memory, as
//! kspeed's page-cache sender reads it: every byte comes from DRAM); the
//! receiver reads them into a 256 MiB buffer it walks like a ring (as a
//! landing ring is), 1 MiB per `read`. Each side prints its wall time, GB/s
//! and CPU seconds (user + system) on one line.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Instant;

fn cpu_seconds() -> f64 {
    kspeed::progress::process_cpu_seconds()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if !(4..=5).contains(&args.len()) {
        eprintln!("usage: socket_copy send|recv ADDR BYTES [SOURCE_BYTES]");
        std::process::exit(2);
    }
    let bytes: u64 = args[3].parse().expect("BYTES is a number");
    let chunk = 1usize << 20;
    match args[1].as_str() {
        "recv" => {
            let l = TcpListener::bind(&args[2]).expect("bind");
            println!("listening");
            std::io::stdout().flush().unwrap();
            let (mut s, _) = l.accept().expect("accept");
            let ring = 256usize << 20;
            let mut buf = vec![0u8; ring];
            let (t0, c0) = (Instant::now(), cpu_seconds());
            let (mut got, mut at) = (0u64, 0usize);
            while got < bytes {
                let want = chunk.min(ring - at).min((bytes - got) as usize);
                let n = s.read(&mut buf[at..at + want]).expect("read");
                if n == 0 {
                    break;
                }
                got += n as u64;
                at = (at + n) % ring;
            }
            report("recv", got, t0, c0);
        }
        "send" => {
            let source: usize = args
                .get(4)
                .map_or(chunk, |a| a.parse().expect("SOURCE_BYTES is a number"))
                .next_multiple_of(chunk);
            // Written, so every page is really there (not the zero page).
            let buf = vec![0x5au8; source];
            // Connected once the source is ready: the receiver's clock
            // starts at the connection.
            let mut s = TcpStream::connect(&args[2]).expect("connect");
            let (t0, c0) = (Instant::now(), cpu_seconds());
            let (mut sent, mut at) = (0u64, 0usize);
            while sent < bytes {
                let n = chunk.min((bytes - sent) as usize);
                s.write_all(&buf[at..at + n]).expect("write");
                sent += n as u64;
                at = (at + chunk) % source;
            }
            s.shutdown(std::net::Shutdown::Write).ok();
            // Wait for the receiver to finish reading.
            let _ = s.read(&mut [0u8; 1]);
            report("send", sent, t0, c0);
        }
        _ => {
            eprintln!("usage: socket_copy send|recv ADDR BYTES [SOURCE_BYTES]");
            std::process::exit(2);
        }
    }
}

/// One line per side; `window` is the copy's start and end in seconds since
/// the Unix epoch, so that concurrent copies can be timed together (from
/// the first start to the last end).
fn report(side: &str, bytes: u64, t0: Instant, c0: f64) {
    let secs = t0.elapsed().as_secs_f64();
    let cpu = cpu_seconds() - c0;
    let end = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    println!(
        "{side}: {bytes} bytes in {secs:.3} s: {:.3} GB/s, CPU {cpu:.3} s ({:.3} s per GB), window {:.6} {end:.6}",
        bytes as f64 / secs / 1e9,
        cpu / (bytes as f64 / 1e9),
        end - secs
    );
}
