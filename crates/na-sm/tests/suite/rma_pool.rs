//! The suite's RMA scenarios again with transfer threads
//! (`SmConfig::rma_threads` = 2 here and `QS_SM_RMA_THREADS=2` in the
//! peers, named `sm_only::rma_pool_...`): contiguous and multi-segment transfers
//! both ways and from both sides, bounds/access/forged-descriptor errors,
//! batches (merged, mixed, refused whole, one transfer failing with
//! `EFAULT` among honest ones, a batch of three `IOV_MAX` windows to a
//! killed peer); and the variable's parse error.

use std::path::PathBuf;

use na_testsuite::{rma, Scenario, Transport};

/// Transfer threads of each side.
const THREADS: usize = 2;

/// The trials, by name.
pub fn trials() -> Vec<(&'static str, Scenario)> {
    vec![
        (
            "rma_pool_put_get_contiguous_and_multi_segment_both_sides",
            put_get,
        ),
        ("rma_pool_rma_bounds_access_and_forged_descriptor_errors", errors),
        (
            "rma_pool_rma_batches_merged_mixed_refused_and_partly_failing",
            batches,
        ),
        ("rma_pool_invalid_rma_threads_env_is_a_clear_error", invalid_env),
    ]
}

/// The trial's transport in the same directory, with transfer threads.
fn pooled(t: &Transport) -> Transport {
    let dir = t
        .peer_env
        .iter()
        .find(|(k, _)| k == na_sm::SOCKET_DIR_ENV)
        .map(|(_, v)| PathBuf::from(v))
        .expect("the sm transport names its socket directory");
    crate::transport_with(dir, None, None, Some(THREADS))
}

// (That these go through the threads was checked by breaking them: with
// the results of the threads dropped, every trial here fails and the
// suite's own RMA trials pass.)

fn put_get(t: &Transport) {
    rma::put_get(&pooled(t));
}

fn errors(t: &Transport) {
    rma::errors(&pooled(t));
}

fn batches(t: &Transport) {
    rma::batches(&pooled(t));
}

/// `QS_SM_RMA_THREADS` that is not a number, or too many, is an error
/// that names the variable and the value; a number is taken.
fn invalid_env(t: &Transport) {
    let dir = pooled(t)
        .peer_env
        .into_iter()
        .find(|(k, _)| k == na_sm::SOCKET_DIR_ENV)
        .map(|(_, v)| v)
        .expect("directory");
    let envcheck = |value: &str| {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .env(na_testsuite::PEER_ENV, "envcheck")
            .env(na_sm::SOCKET_DIR_ENV, &dir)
            .env(na_sm::RMA_THREADS_ENV, value)
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    for bad in ["two", "-1", "65", ""] {
        let s = envcheck(bad);
        assert!(
            s.starts_with("ERR") && s.contains("QS_SM_RMA_THREADS") && s.contains(&format!("{bad:?}")),
            "{bad:?}: {s}"
        );
    }
    let s = envcheck("two");
    assert!(s.contains("number of RMA transfer threads"), "{s}");
    for good in ["0", "2", " 4 "] {
        let s = envcheck(good);
        assert!(s.starts_with("OK "), "{good:?}: {s}");
    }
}
