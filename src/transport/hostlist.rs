//! SLURM's hostlist grammar (`SLURM_JOB_NODELIST`, `scontrol show
//! hostnames`): `gpu[01-04,07]`, `a[1-2],b3`, `rack[1-2]-n[01-02]`.
//!
//! Written here rather than taken from a crate: the grammar is small, the
//! crates that parse it are young single-author ones, and kspeed needs its
//! own bounds (a hostlist from the environment must not expand into an
//! unbounded allocation) and errors that say where the text is wrong.
//!
//! The grammar, as SLURM writes and reads it:
//!
//! - items are separated by commas (or whitespace) outside brackets;
//! - an item is literal text with any number of bracket groups; each group
//!   is a comma-separated list of numbers `7` or ranges `lo-hi` (`lo <= hi`);
//! - a range keeps the width of its lower bound: `[08-10]` gives `08 09 10`,
//!   `[8-10]` gives `8 9 10`;
//! - several groups expand as a cartesian product, the first group varying
//!   slowest (`a[1-2]b[1-2]`: `a1b1 a1b2 a2b1 a2b2`), as SLURM orders them.
//!
//! Hosts come out in the order written; a host named twice is an error
//! (two node indices on one node service would double its share).

use std::collections::HashSet;

use crate::error::{Error, Result};

/// The most hosts one hostlist may expand to (far above any cluster; a
/// typo like `n[0-99999999]` is an error, not an allocation).
pub const MAX_HOSTS: usize = 1 << 16;

/// Expands a hostlist into host names, in order.
///
/// Errors ([`Error::BadHostlist`], naming the byte offset): unbalanced or
/// nested brackets, an empty group or range bound, a bound that is not a
/// decimal number, `lo > hi`, an empty host name, a host listed twice, or
/// more than [`MAX_HOSTS`] hosts.
pub fn expand(list: &str) -> Result<Vec<String>> {
    let mut out = Vec::new();
    let mut seen = HashSet::new();
    for (start, item) in split_items(list)? {
        let parts = parse_item(list, start, item)?;
        let before = out.len();
        product(&parts, &mut String::new(), &mut out, list)?;
        for (k, host) in out[before..].iter().enumerate() {
            if !seen.insert(host.clone()) {
                return Err(bad(
                    list,
                    start,
                    format!("host {host:?} is listed twice (entry {})", before + k),
                ));
            }
        }
    }
    if out.is_empty() {
        return Err(bad(list, 0, "no hosts listed".into()));
    }
    Ok(out)
}

fn bad(list: &str, at: usize, reason: String) -> Error {
    Error::BadHostlist {
        list: list.to_string(),
        at,
        reason,
    }
}

/// Top-level items (byte offset, text): split at commas and whitespace
/// outside brackets.
fn split_items(list: &str) -> Result<Vec<(usize, &str)>> {
    let mut items = Vec::new();
    let mut depth = 0usize;
    let mut open_at = 0usize;
    let mut start = 0usize;
    for (i, c) in list.char_indices() {
        match c {
            '[' => {
                if depth > 0 {
                    return Err(bad(list, i, "nested `[`".into()));
                }
                depth = 1;
                open_at = i;
            }
            ']' => {
                if depth == 0 {
                    return Err(bad(list, i, "`]` without `[`".into()));
                }
                depth = 0;
            }
            ',' | ' ' | '\t' | '\n' if depth == 0 => {
                if i > start {
                    items.push((start, &list[start..i]));
                } else if c == ',' {
                    return Err(bad(list, i, "empty host name before `,`".into()));
                }
                start = i + c.len_utf8();
            }
            _ => {}
        }
    }
    if depth > 0 {
        return Err(bad(list, open_at, "`[` is never closed".into()));
    }
    if start < list.len() {
        items.push((start, &list[start..]));
    } else if list.trim_end().ends_with(',') {
        return Err(bad(list, list.len(), "empty host name after `,`".into()));
    }
    Ok(items)
}

/// One piece of an item: literal text, or the values of a bracket group
/// (already formatted with their width).
enum Part<'a> {
    Text(&'a str),
    Group(Vec<String>),
}

fn parse_item<'a>(list: &str, start: usize, item: &'a str) -> Result<Vec<Part<'a>>> {
    let mut parts = Vec::new();
    let mut rest = item;
    let mut off = start;
    let mut count: usize = 1;
    while let Some(open) = rest.find('[') {
        if open > 0 {
            parts.push(Part::Text(&rest[..open]));
        }
        let close = rest[open..].find(']').expect("split_items checked balance") + open;
        let body = &rest[open + 1..close];
        let values = parse_group(list, off + open + 1, body)?;
        count = count.saturating_mul(values.len());
        if count > MAX_HOSTS {
            return Err(bad(
                list,
                start,
                format!("expands to more than {MAX_HOSTS} hosts"),
            ));
        }
        parts.push(Part::Group(values));
        off += close + 1;
        rest = &rest[close + 1..];
    }
    if !rest.is_empty() {
        parts.push(Part::Text(rest));
    }
    Ok(parts)
}

fn parse_group(list: &str, at: usize, body: &str) -> Result<Vec<String>> {
    if body.trim().is_empty() {
        return Err(bad(list, at, "empty `[]`".into()));
    }
    let mut values = Vec::new();
    let mut off = at;
    for piece in body.split(',') {
        let num = |s: &str, at: usize| -> Result<u64> {
            if s.is_empty() {
                return Err(bad(list, at, "a range bound is missing".into()));
            }
            if !s.bytes().all(|b| b.is_ascii_digit()) {
                return Err(bad(list, at, format!("{s:?} is not a decimal number")));
            }
            s.parse::<u64>()
                .map_err(|_| bad(list, at, format!("{s:?} is too large")))
        };
        let (lo_s, hi_s) = match piece.split_once('-') {
            Some((lo, hi)) => (lo, Some(hi)),
            None => (piece, None),
        };
        let lo = num(lo_s, off)?;
        let hi = match hi_s {
            Some(h) => num(h, off + lo_s.len() + 1)?,
            None => lo,
        };
        if hi < lo {
            return Err(bad(
                list,
                off,
                format!("range {piece:?} runs backwards ({lo} > {hi})"),
            ));
        }
        if hi - lo >= MAX_HOSTS as u64 || values.len() + (hi - lo) as usize >= MAX_HOSTS {
            return Err(bad(
                list,
                off,
                format!("range {piece:?} expands to more than {MAX_HOSTS} hosts"),
            ));
        }
        // The lower bound's width is the padding (SLURM's rule).
        let width = lo_s.len();
        for v in lo..=hi {
            values.push(format!("{v:0width$}"));
        }
        off += piece.len() + 1;
    }
    Ok(values)
}

fn product(
    parts: &[Part<'_>],
    prefix: &mut String,
    out: &mut Vec<String>,
    list: &str,
) -> Result<()> {
    match parts.split_first() {
        None => {
            if out.len() >= MAX_HOSTS {
                return Err(bad(
                    list,
                    0,
                    format!("expands to more than {MAX_HOSTS} hosts"),
                ));
            }
            out.push(prefix.clone());
        }
        Some((Part::Text(t), rest)) => {
            let len = prefix.len();
            prefix.push_str(t);
            product(rest, prefix, out, list)?;
            prefix.truncate(len);
        }
        Some((Part::Group(values), rest)) => {
            let len = prefix.len();
            for v in values {
                prefix.push_str(v);
                product(rest, prefix, out, list)?;
                prefix.truncate(len);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ex(s: &str) -> Vec<String> {
        expand(s).unwrap_or_else(|e| panic!("{s:?}: {e}"))
    }

    fn err(s: &str) -> String {
        expand(s).expect_err(s).to_string()
    }

    #[test]
    fn expands_ranges_lists_and_padding() {
        assert_eq!(
            ex("gpu[01-04,07]"),
            ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07"]
        );
        assert_eq!(ex("a[1-2],b3"), ["a1", "a2", "b3"]);
        assert_eq!(ex("n[8-11]"), ["n8", "n9", "n10", "n11"]);
        assert_eq!(ex("n[098-101]"), ["n098", "n099", "n100", "n101"]);
        assert_eq!(ex("single"), ["single"]);
        assert_eq!(ex("x[5]"), ["x5"]);
        assert_eq!(
            ex("node-[1-2].example.org"),
            ["node-1.example.org", "node-2.example.org"]
        );
        // Whitespace separates like a comma (scontrol accepts both).
        assert_eq!(ex(" a1 b2,c3 "), ["a1", "b2", "c3"]);
    }

    #[test]
    fn several_groups_expand_first_group_slowest() {
        assert_eq!(
            ex("rack[1-2]-n[01-02]"),
            ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]
        );
        assert_eq!(ex("a[1-2]b[3,5]c"), ["a1b3c", "a1b5c", "a2b3c", "a2b5c"]);
        assert_eq!(ex("[1-2]x"), ["1x", "2x"]);
    }

    #[test]
    fn bad_grammar_is_named_with_its_offset() {
        let e = err("gpu[01-04");
        assert!(e.contains("never closed") && e.contains("at byte 3"), "{e}");
        let e = err("gpu01-04]");
        assert!(e.contains("without `[`") && e.contains("at byte 8"), "{e}");
        assert!(err("a[1-[2]]").contains("nested"));
        assert!(err("a[]").contains("empty `[]`"));
        assert!(err("a[1-]").contains("bound is missing"));
        assert!(err("a[-3]").contains("bound is missing"));
        let e = err("a[5-3]");
        assert!(e.contains("backwards"), "{e}");
        let e = err("a[1-x]");
        assert!(
            e.contains("\"x\" is not a decimal number") && e.contains("at byte 4"),
            "{e}"
        );
        assert!(err("a,,b").contains("empty host name"));
        assert!(err("a,").contains("empty host name"));
        assert!(err("").contains("no hosts"));
        assert!(err("a[1-2],a2").contains("listed twice"));
        assert!(err("n[0-99999999]").contains("more than"));
        assert!(err("a[0-999]b[0-999]").contains("more than"));
        assert!(err("a[99999999999999999999]").contains("too large"));
    }
}
