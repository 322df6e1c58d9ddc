//! Which handles an encoder lends (`collect_lent`): a handle whose data
//! travels inline (small and read-only) is not lent, since a target never
//! touches its memory; any other local handle is. Real sm plugin.

use hg_bulk::{collect_lent, Bulk, INLINE_MAX};
use na_core::{Access, Endpoint, Plugin, ProgressMode};
use na_sm::{SmConfig, SmPlugin};

#[test]
fn only_handles_a_target_may_reach_are_lent() {
    let dir = std::env::temp_dir().join(format!("hg-bulk-lent-inline-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let cfg = SmConfig {
        listen: true,
        ..SmConfig::default()
    }
    .with_dir(&dir);
    let mut ep = Endpoint::new(ProgressMode::Busy).unwrap();
    let p = ep
        .add_plugin(|id| Ok(Box::new(SmPlugin::new(id, cfg)?) as Box<dyn Plugin>))
        .unwrap();
    let small_ro = Bulk::expose(&mut ep, p, vec![vec![1u8; 16]], Access::ReadOnly).unwrap();
    let large_ro = Bulk::expose(&mut ep, p, vec![vec![2u8; INLINE_MAX + 1]], Access::ReadOnly).unwrap();
    let small_rw = Bulk::expose(&mut ep, p, vec![vec![3u8; 16]], Access::ReadWrite).unwrap();
    let (bytes, lent) = collect_lent(|| postcard::to_allocvec(&(&small_ro, &large_ro, &small_rw)).unwrap());
    assert!(!bytes.is_empty());
    let lent = lent.expect("two handles lent");
    assert_eq!(lent.len(), 2, "the inline handle was lent too");
    assert!(lent[0].same_as(large_ro.local().unwrap()));
    assert!(lent[1].same_as(small_rw.local().unwrap()));
    drop(lent);
    assert!(small_ro.into_buffers().is_ok());
    let _ = std::fs::remove_dir_all(&dir);
}
