//! `qs-sm-cleanup [DIR]`: removes socket and owner files of dead na-sm
//! processes from DIR (default: `$QS_SM_DIR`, else `/tmp/qs-sm-<uid>`),
//! keeping those of live ones, in this PID namespace or another (a live
//! owner holds its owner file's lock; see [`na_sm::cleanup_stale`], which
//! does the work, and [`na_sm::CleanupReport`], what it returns). Prints
//! what it removed and kept; exits 1 on error.

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "-h" || a == "--help") || args.len() > 1 {
        eprintln!("usage: qs-sm-cleanup [DIR]\n  removes na-sm socket files whose owner process is dead");
        std::process::exit(if args.len() > 1 { 2 } else { 0 });
    }
    let dir = match args.first() {
        Some(d) => std::path::PathBuf::from(d),
        None => match na_sm::default_dir() {
            Ok(d) => d,
            Err(e) => {
                eprintln!("qs-sm-cleanup: {}", na_core::ErrorChain(&e));
                std::process::exit(1);
            }
        },
    };
    match na_sm::cleanup_stale(&dir) {
        Ok(r) => {
            for f in &r.removed {
                println!("removed {}", f.display());
            }
            for f in &r.kept {
                println!("kept {} (owner alive)", f.display());
            }
            println!(
                "{}: {} removed, {} kept",
                dir.display(),
                r.removed.len(),
                r.kept.len()
            );
        }
        Err(e) => {
            eprintln!("qs-sm-cleanup: {}", na_core::ErrorChain(&e));
            std::process::exit(1);
        }
    }
}
