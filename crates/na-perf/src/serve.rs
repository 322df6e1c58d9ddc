//! The peer process (`na-perf serve`): pins itself, takes the inherited
//! floor channels, then answers one command per stdin line:
//!
//! | command | does | answers |
//! | --- | --- | --- |
//! | `flag <size>` | echoes the shared-memory flag ping-pong | `ok`, then `ok` when stopped |
//! | `eventfd <size>` | echoes the eventfd ping-pong | `ok`, then `ok` when stopped |
//! | `cma <size> <segments>` | allocates buffers for the CMA floor | `ok addr:len ...` |
//! | `sm` | serves one NA session (see [`crate::sm_server`]) | `ok <address>`, then `ok` at its end |
//! | `sm pull` | the same, taking unexpected messages in pull mode | the same |
//! | `quit` | exits | nothing |
//!
//! With `--standalone` it serves NA sessions one after another instead,
//! printing its address once.

use std::io::{BufRead, Write};

use crate::cli::ServeArgs;
use crate::error::{PerfError, Result};
use crate::floors;
use crate::peer::FloorLinks;
use crate::sm_server;
use crate::sys::eventfd::EventFd;
use crate::sys::fd::take_inherited;
use crate::sys::shm::SharedMap;

/// Writes one answer line and flushes it.
pub fn answer(line: &str) -> Result<()> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}")
        .and_then(|()| out.flush())
        .map_err(|source| PerfError::PeerIo {
            what: "answering",
            source,
        })
}

fn take_links(fds: &[i32]) -> Result<Option<FloorLinks>> {
    let [to, from, mem] = match fds {
        [] => return Ok(None),
        [a, b, c] => [*a, *b, *c],
        _ => {
            return Err(PerfError::Arg {
                name: "--floor-fds",
                reason: "expected three descriptors".into(),
            })
        }
    };
    let efd = |fd| take_inherited(fd, na_core::sys::eventfd::PROC_LINK).map(EventFd::from_owned);
    Ok(Some(FloorLinks {
        to_peer: efd(to).map_err(PerfError::sys("inherited eventfd"))?,
        from_peer: efd(from).map_err(PerfError::sys("inherited eventfd"))?,
        shm: take_inherited(mem, "/memfd:")
            .and_then(SharedMap::from_owned)
            .map_err(PerfError::sys("inherited memfd"))?,
    }))
}

/// Runs the peer.
pub fn run(args: &ServeArgs) -> Result<()> {
    if let Some(parent) = args.parent {
        na_core::sys::process::exit_with_parent(parent).map_err(PerfError::sys("prctl(PR_SET_PDEATHSIG)"))?;
    }
    crate::peer::pin_self(args.pin)?;
    let links = take_links(&args.floor_fds)?;
    if args.standalone {
        return sm_server::serve_forever();
    }
    answer("ok ready")?;
    let mut cma_buffers = Vec::new();
    for line in std::io::stdin().lock().lines() {
        let line = line.map_err(|source| PerfError::PeerIo {
            what: "reading a command",
            source,
        })?;
        let words: Vec<&str> = line.split_whitespace().collect();
        if words.first() == Some(&"quit") {
            break;
        }
        if let Err(e) = command(&words, links.as_ref(), &mut cma_buffers) {
            answer(&format!("err {}", na_core::ErrorChain(&e)))?;
        }
    }
    Ok(())
}

fn number(words: &[&str], i: usize) -> Result<usize> {
    words
        .get(i)
        .and_then(|w| w.parse().ok())
        .ok_or_else(|| PerfError::Arg {
            name: "peer command",
            reason: format!("{:?}: argument {i} is missing or not a number", words.join(" ")),
        })
}

fn command(words: &[&str], links: Option<&FloorLinks>, cma_buffers: &mut Vec<Vec<u8>>) -> Result<()> {
    let need_links = || {
        links.ok_or(PerfError::Arg {
            name: "peer command",
            reason: "started without floor channels".into(),
        })
    };
    match words.first().copied().unwrap_or("") {
        "flag" => {
            let (l, size) = (need_links()?, number(words, 1)?);
            answer("ok")?;
            floors::serve_shm_flag(l, size)?;
            answer("ok")
        }
        "eventfd" => {
            let (l, size) = (need_links()?, number(words, 1)?);
            answer("ok")?;
            floors::serve_eventfd(l, size)?;
            answer("ok")
        }
        "cma" => {
            let ranges = floors::serve_cma(cma_buffers, number(words, 1)?, number(words, 2)?);
            answer(&format!("ok {ranges}"))
        }
        "sm" => {
            let pull = match words.get(1).copied() {
                None => false,
                Some("pull") => true,
                Some(w) => {
                    return Err(PerfError::Arg {
                        name: "peer command",
                        reason: format!("sm takes nothing or `pull`, not {w:?}"),
                    })
                }
            };
            sm_server::serve_session(pull, |addr| answer(&format!("ok {addr}"))).and_then(|()| answer("ok"))
        }
        other => Err(PerfError::Arg {
            name: "peer command",
            reason: format!("unknown command {other:?}"),
        }),
    }
}
