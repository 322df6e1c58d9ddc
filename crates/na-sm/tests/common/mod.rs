//! Helpers shared by na-sm's integration tests.

/// A new, empty socket directory private to this user (mode 0700, as sm
/// requires), named by `tag` and this process; the caller removes it.
pub fn private_dir(tag: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("qs-sm-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    dir
}
