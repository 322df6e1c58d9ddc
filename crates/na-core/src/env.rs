//! Reading configuration from environment variables, the one way every
//! Quicksilver crate does it: unset is `None`, and a value that is not
//! UTF-8 is an error that names the variable (never silently ignored).

/// The value of environment variable `name`, `None` if it is unset. A
/// value that is not UTF-8 gives the error `bad(value, reason)`, with the
/// value converted lossily and the reason `"not valid UTF-8"`; callers
/// build their crate's configuration error from it (naming `name`).
pub fn env_var<E>(name: &str, bad: impl FnOnce(String, &'static str) -> E) -> Result<Option<String>, E> {
    match std::env::var(name) {
        Ok(v) => Ok(Some(v)),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(v)) => {
            Err(bad(v.to_string_lossy().into_owned(), "not valid UTF-8"))
        }
    }
}

#[cfg(test)]
mod tests {
    use std::ffi::OsStr;
    use std::os::unix::ffi::OsStrExt;

    use super::env_var;

    #[test]
    fn unset_set_and_non_utf8_values() {
        // Variables private to this test: nothing else reads them.
        let (unset, set, bad) = ("QS_TEST_ENV_UNSET_1", "QS_TEST_ENV_SET_1", "QS_TEST_ENV_BAD_1");
        std::env::remove_var(unset);
        std::env::set_var(set, " on ");
        std::env::set_var(bad, OsStr::from_bytes(b"o\xffn"));
        let err = |v: String, r: &'static str| (v, r);
        assert_eq!(env_var(unset, err), Ok(None));
        assert_eq!(env_var(set, err), Ok(Some(" on ".to_owned())));
        assert_eq!(
            env_var(bad, err),
            Err(("o\u{fffd}n".to_owned(), "not valid UTF-8"))
        );
    }
}
