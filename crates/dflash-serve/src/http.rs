//! A minimal HTTP/1.1 layer over `std::net::TcpStream`: one request a connection
//! (`Connection: close`), heads parsed by `httparse`, bodies by `Content-Length` only.
//!
//! Invariants: a head longer than [`MAX_HEAD`] or a body longer than the caller's limit is
//! refused before it is read (431 / 413); a request without `Content-Length` has an empty body
//! unless it says `Transfer-Encoding` (refused, 411); every response this module writes carries
//! its length, except event streams, which end when the connection closes.

use std::io::{Read, Write};

/// The longest request head read (request line and headers).
pub const MAX_HEAD: usize = 64 << 10;

/// A parsed request.
#[derive(Debug, Clone)]
pub struct Request {
    pub method: String,
    /// The path without its query string.
    pub path: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Request {
    /// The value of header `name` (case-insensitive), if present.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// A request that could not be read: the status to answer with and why.
#[derive(Debug)]
pub struct HttpError {
    pub status: u16,
    pub message: String,
}

fn bad(status: u16, message: impl Into<String>) -> HttpError {
    HttpError {
        status,
        message: message.into(),
    }
}

/// Reads one request from `stream`; `Ok(None)` when the peer closed before sending anything.
pub fn read_request(stream: &mut impl Read, max_body: usize) -> Result<Option<Request>, HttpError> {
    let mut buf = Vec::with_capacity(4096);
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(i) = find(&buf, b"\r\n\r\n") {
            break i + 4;
        }
        if buf.len() > MAX_HEAD {
            return Err(bad(431, "request head too large"));
        }
        let n = stream
            .read(&mut chunk)
            .map_err(|e| bad(408, format!("reading the request: {e}")))?;
        if n == 0 {
            if buf.is_empty() {
                return Ok(None);
            }
            return Err(bad(400, "connection closed inside the request head"));
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(&buf[..head_end]) {
        Ok(httparse::Status::Complete(_)) => {}
        Ok(httparse::Status::Partial) => return Err(bad(400, "incomplete request head")),
        Err(e) => return Err(bad(400, format!("malformed request: {e}"))),
    }
    let method = req.method.unwrap_or_default().to_string();
    let target = req.path.unwrap_or("/");
    let path = target.split('?').next().unwrap_or("/").to_string();
    let headers: Vec<(String, String)> = req
        .headers
        .iter()
        .map(|h| {
            (
                h.name.to_string(),
                String::from_utf8_lossy(h.value).trim().to_string(),
            )
        })
        .collect();
    let mut out = Request {
        method,
        path,
        headers,
        body: vec![],
    };
    if out.header("transfer-encoding").is_some() {
        return Err(bad(411, "send the body with a Content-Length"));
    }
    let len = match out.header("content-length") {
        None => 0,
        Some(v) => v
            .parse::<usize>()
            .map_err(|_| bad(400, format!("bad Content-Length {v:?}")))?,
    };
    if len > max_body {
        return Err(bad(413, format!("body of {len} bytes; at most {max_body}")));
    }
    let mut body = buf[head_end..].to_vec();
    body.truncate(len);
    while body.len() < len {
        let n = stream
            .read(&mut chunk)
            .map_err(|e| bad(408, format!("reading the body: {e}")))?;
        if n == 0 {
            return Err(bad(400, "connection closed inside the body"));
        }
        let take = n.min(len - body.len());
        body.extend_from_slice(&chunk[..take]);
    }
    out.body = body;
    Ok(Some(out))
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// The reason phrase of the statuses this server sends.
pub fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        401 => "Unauthorized",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        411 => "Length Required",
        413 => "Payload Too Large",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        _ => "Unknown",
    }
}

/// Writes a complete response with a body of `content_type`.
pub fn write_response(
    stream: &mut impl Write,
    status: u16,
    content_type: &str,
    body: &[u8],
) -> std::io::Result<()> {
    write!(
        stream,
        "HTTP/1.1 {status} {}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        reason(status),
        body.len()
    )?;
    stream.write_all(body)?;
    stream.flush()
}

/// Writes the head of a Server-Sent Events response; events follow with [`write_event`] and the
/// stream ends when the connection closes.
pub fn write_event_stream_head(stream: &mut impl Write) -> std::io::Result<()> {
    stream.write_all(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\nConnection: close\r\n\r\n",
    )?;
    stream.flush()
}

/// Writes one event (`data: …` and a blank line) and flushes it.
pub fn write_event(stream: &mut impl Write, data: &str) -> std::io::Result<()> {
    stream.write_all(b"data: ")?;
    stream.write_all(data.as_bytes())?;
    stream.write_all(b"\n\n")?;
    stream.flush()
}

/// A one-shot client: sends `method path` with a JSON `body` (if any) to `addr` and returns the
/// status and the whole body (the server closes the connection after it). For health checks,
/// scripts and tests.
pub fn call(
    addr: &str,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> std::io::Result<(u16, String)> {
    let mut s = std::net::TcpStream::connect(addr)?;
    let body = body.unwrap_or("");
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    let bad = || std::io::Error::new(std::io::ErrorKind::InvalidData, "not an HTTP response");
    let (head, rest) = out.split_once("\r\n\r\n").ok_or_else(bad)?;
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(bad)?;
    Ok((status, rest.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_a_request_with_its_body_in_pieces() {
        let raw = b"POST /v1/completions?x=1 HTTP/1.1\r\nHost: a\r\nContent-Length: 11\r\n\r\nhello world";
        let r = read_request(&mut &raw[..], 100).unwrap().unwrap();
        assert_eq!(
            (r.method.as_str(), r.path.as_str(), r.body.as_slice()),
            ("POST", "/v1/completions", &b"hello world"[..])
        );
        assert_eq!(r.header("HOST"), Some("a"));
    }

    #[test]
    fn refuses_oversized_bodies_chunked_bodies_and_garbage() {
        let big = b"POST / HTTP/1.1\r\nContent-Length: 1000\r\n\r\n";
        assert_eq!(read_request(&mut &big[..], 10).unwrap_err().status, 413);
        let chunked = b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n";
        assert_eq!(read_request(&mut &chunked[..], 10).unwrap_err().status, 411);
        let garbage = b"\x01\x02 nonsense\r\n\r\n";
        assert_eq!(read_request(&mut &garbage[..], 10).unwrap_err().status, 400);
        let short = b"POST / HTTP/1.1\r\nContent-Length: 5\r\n\r\nab";
        assert_eq!(read_request(&mut &short[..], 10).unwrap_err().status, 400);
        assert!(read_request(&mut &b""[..], 10).unwrap().is_none());
    }
}
