//! Support this crate's unit and integration tests share (the
//! `test-hooks` feature; never in a user's build).

/// Set in the process [`debug_run_alone`] starts for one test.
const ALONE_ENV: &str = "QS_SM_TEST_ALONE";

/// Test hook (`test-hooks` feature): runs `body`, the test named `test`
/// (its full path in the test binary), in a process of its own: this test
/// binary again, running that test only. nextest runs each test in a
/// process of its own already; plain `cargo test` runs a binary's tests
/// side by side in one process, where process-wide state one test sets up
/// (closing threads, the flags a fork inherits, open descriptors) is the
/// others'. Panics with the process's output if the test failed there (or
/// the name matched no test: libtest then exits 0 with "0 passed").
#[doc(hidden)]
pub fn debug_run_alone(test: &str, body: impl FnOnce()) {
    let per_process = std::env::var("NEXTEST_EXECUTION_MODE").is_ok_and(|m| m == "process-per-test");
    if per_process || std::env::var_os(ALONE_ENV).is_some() {
        return body();
    }
    let out = std::process::Command::new(std::env::current_exe().expect("the test binary's path"))
        .args(["--exact", test, "--nocapture", "--test-threads=1"])
        .env(ALONE_ENV, "1")
        .output()
        .expect("run the test binary again");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "{test}, alone in a process: {}\n--- stdout\n{stdout}\n--- stderr\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}
