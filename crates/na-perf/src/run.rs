//! What `lat` and `bw` share: pinning, the peer process (started here or
//! reached at `--peer`) and the NA session with it.

use na_core::ProgressMode;

use crate::cli::CommonArgs;
use crate::error::{PerfError, Result};
use crate::peer::{choose_cpus, pin_self, Peer};
use crate::sm_client::Session;

/// The peer of a run.
pub struct Setup {
    peer: Option<Peer>,
    uri: Option<String>,
}

impl Setup {
    /// Starts the peer process (unless `--peer` names one) and pins both
    /// processes.
    pub fn start(args: &CommonArgs) -> Result<Setup> {
        let (mine, theirs) = choose_cpus(args)?;
        let spec = crate::sm_server::transport();
        if args.floors && !spec.starts_with("sm:") {
            return Err(PerfError::Arg {
                name: "--floors",
                reason: format!("the raw floors are shared-memory floors; they do not apply to {spec}"),
            });
        }
        let setup = match &args.peer {
            Some(uri) if args.floors => {
                return Err(PerfError::Arg {
                    name: "--floors",
                    reason: format!(
                        "floors need the peer process that na-perf starts itself; drop --peer {uri}"
                    ),
                })
            }
            Some(uri) => Setup {
                peer: None,
                uri: Some(uri.clone()),
            },
            None => Setup {
                peer: Some(Peer::spawn(theirs, args.floors)?),
                uri: None,
            },
        };
        pin_self(mine)?;
        Ok(setup)
    }

    /// The peer process started by us (for the floors).
    pub fn local_peer(&mut self) -> Result<&mut Peer> {
        self.peer.as_mut().ok_or(PerfError::Arg {
            name: "--floors",
            reason: "no local peer process".into(),
        })
    }

    /// Opens the NA session in `mode`; with `pull`, both sides take
    /// unexpected messages in pull mode (a peer na-perf started only).
    pub fn connect(&mut self, mode: ProgressMode, pull: bool) -> Result<Session> {
        let uri = match (&self.uri, &mut self.peer) {
            (Some(uri), _) if pull => {
                return Err(PerfError::Arg {
                    name: "--kind pulled",
                    reason: format!("needs the peer process that na-perf starts itself; drop --peer {uri}"),
                })
            }
            (Some(uri), _) => uri.clone(),
            (None, Some(peer)) => peer.request(if pull { "sm pull" } else { "sm" })?,
            (None, None) => unreachable!("Setup::start sets a peer or an address"),
        };
        Session::connect(&uri, mode, pull)
    }

    /// Ends the session; a local peer then reports the session's end (and
    /// may serve another).
    pub fn end_session(&mut self, session: Session) -> Result<()> {
        session.bye()?;
        if let Some(peer) = &mut self.peer {
            peer.reply("sm <end>")?;
        }
        Ok(())
    }

    /// Ends the session and the run.
    pub fn finish(mut self, session: Session) -> Result<()> {
        self.end_session(session)
    }
}
