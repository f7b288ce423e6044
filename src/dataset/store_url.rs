//! Where a remote source lives: `s3://bucket/key`, or a web server's
//! `https://host[:port]/path` (the origin in the bucket's place), parsed and
//! printed; no client here (`store.rs` has it).

use crate::error::{Error, Result};

/// The URL scheme of S3 sources.
pub const S3_SCHEME: &str = "s3://";

/// A location in an object store: a bucket and a key (or key prefix).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct StoreUrl {
    /// The bucket; for an `https://` or `http://` URL its origin
    /// (`https://host[:port]`), the server that holds the "keys" (paths).
    pub bucket: String,
    /// The key or prefix, without a leading `/` (a prefix ends in `/`, or
    /// is empty for the whole bucket).
    pub key: String,
}

impl StoreUrl {
    /// Parses `s3://bucket/key`, or `https://host[:port]/path` (`http://`
    /// too). None: not such a URL.
    pub fn parse(s: &str) -> Option<Result<StoreUrl>> {
        for scheme in ["https://", "http://"] {
            let Some(rest) = s.strip_prefix(scheme) else {
                continue;
            };
            let (host, path) = rest.split_once('/').unwrap_or((rest, ""));
            if host.is_empty()
                || host
                    .bytes()
                    .any(|b| b.is_ascii_whitespace() || b"?#@".contains(&b))
            {
                return Some(Err(Error::InvalidConfig(format!(
                    "source {s:?} names no host ({scheme}HOST[:PORT]/PATH)"
                ))));
            }
            return Some(Ok(StoreUrl {
                bucket: format!("{scheme}{host}"),
                key: path.trim_start_matches('/').to_string(),
            }));
        }
        let rest = s.strip_prefix(S3_SCHEME)?;
        let (bucket, key) = rest.split_once('/').unwrap_or((rest, ""));
        if bucket.is_empty() {
            return Some(Err(Error::InvalidConfig(format!(
                "source {s:?} names no bucket (s3://BUCKET/PREFIX/)"
            ))));
        }
        // Bucket names are 3-63 of [a-z0-9.-] on AWS; S3-compatible stores
        // allow more, so only what cannot be part of a host or path is refused.
        if bucket
            .bytes()
            .any(|b| b.is_ascii_whitespace() || b == b'?' || b == b'#' || b == b'@')
        {
            return Some(Err(Error::InvalidConfig(format!(
                "source {s:?}: {bucket:?} is not a bucket name"
            ))));
        }
        Some(Ok(StoreUrl {
            bucket: bucket.to_string(),
            key: key.trim_start_matches('/').to_string(),
        }))
    }

    /// Whether this names a web server's path (`https://`, `http://`),
    /// not an S3 bucket's key.
    pub fn is_http(&self) -> bool {
        is_http_origin(&self.bucket)
    }

    /// `s3://bucket/key`, or `https://host/path`.
    pub fn to_url(&self) -> String {
        format!("{}/{}", base_url(&self.bucket), self.key)
    }

    /// The URL of `name` under this prefix (for messages and change reports).
    pub fn child(&self, name: &str) -> String {
        if self.key.is_empty() || self.key.ends_with('/') {
            format!("{}/{}{}", base_url(&self.bucket), self.key, name)
        } else {
            format!("{}/{}/{}", base_url(&self.bucket), self.key, name)
        }
    }

    /// The prefix ending in `/` (empty for the bucket's root).
    pub fn dir_prefix(&self) -> String {
        if self.key.is_empty() || self.key.ends_with('/') {
            self.key.clone()
        } else {
            format!("{}/", self.key)
        }
    }

    /// The "directory" of the key: everything up to its last `/`, with it.
    pub fn parent_prefix(&self) -> String {
        match self.key.rfind('/') {
            Some(i) => self.key[..=i].to_string(),
            None => String::new(),
        }
    }
}

/// Whether a [`StoreUrl::bucket`] is a web server's origin.
pub(super) fn is_http_origin(bucket: &str) -> bool {
    bucket.starts_with("https://") || bucket.starts_with("http://")
}

/// `s3://bucket`, or the origin itself.
pub(super) fn base_url(bucket: &str) -> String {
    if is_http_origin(bucket) {
        bucket.to_string()
    } else {
        format!("{S3_SCHEME}{bucket}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse_and_print() {
        let u = StoreUrl::parse("s3://b/p/q/").unwrap().unwrap();
        assert_eq!((u.bucket.as_str(), u.key.as_str()), ("b", "p/q/"));
        assert_eq!(u.child("c/x.jpg"), "s3://b/p/q/c/x.jpg");
        assert_eq!(u.dir_prefix(), "p/q/");
        let u = StoreUrl::parse("s3://b").unwrap().unwrap();
        assert_eq!((u.key.as_str(), u.dir_prefix().as_str()), ("", ""));
        let u = StoreUrl::parse("s3://b/lists/train.txt").unwrap().unwrap();
        assert_eq!(u.parent_prefix(), "lists/");
        assert!(StoreUrl::parse("s3:///x").unwrap().is_err());
        assert!(StoreUrl::parse("/data").is_none());
    }

    #[test]
    fn web_urls_have_their_origin_as_bucket() {
        let u = StoreUrl::parse("https://h.example:8443/data/files.txt")
            .unwrap()
            .unwrap();
        assert_eq!(
            (u.bucket.as_str(), u.key.as_str()),
            ("https://h.example:8443", "data/files.txt")
        );
        assert!(u.is_http());
        assert_eq!(u.to_url(), "https://h.example:8443/data/files.txt");
        assert_eq!(u.parent_prefix(), "data/");
        let u = StoreUrl::parse("http://127.0.0.1/x.tar").unwrap().unwrap();
        assert_eq!(u.child(""), "http://127.0.0.1/x.tar/");
        assert!(StoreUrl::parse("https:///x").unwrap().is_err());
        assert!(!StoreUrl::parse("s3://b/k").unwrap().unwrap().is_http());
    }
}
