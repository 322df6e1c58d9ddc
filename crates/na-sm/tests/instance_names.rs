//! Within one process an instance name belongs to one instance at a time,
//! listening or not (a server would take two clients of one name for one
//! peer); unnamed instances get numbers no instance holds.

use na_core::{Plugin, PluginId};
use na_sm::{SmConfig, SmError, SmPlugin};

mod common;

#[test]
fn a_name_in_use_in_this_process_is_refused_until_its_instance_is_dropped() {
    let dir = common::private_dir("names");
    let client = |name: &str| SmPlugin::new(PluginId(1), SmConfig::default().with_dir(&dir).with_name(name));
    let first = client("dup").unwrap();
    let e = client("dup").map(|_| ()).unwrap_err();
    assert!(
        matches!(&e, SmError::NameInUse { uri } if uri.ends_with("-dup")),
        "{}",
        na_core::ErrorChain(&e)
    );
    // A listening one may not take a client's name either.
    let e = SmPlugin::new(PluginId(2), SmConfig::listening().with_dir(&dir).with_name("dup"))
        .map(|_| ())
        .unwrap_err();
    assert!(
        matches!(e, SmError::NameInUse { .. }),
        "{}",
        na_core::ErrorChain(&e)
    );
    assert_eq!(
        std::fs::read_dir(&dir).unwrap().count(),
        0,
        "the refused one made files"
    );
    // Nor a client a listener's.
    let _srv = SmPlugin::new(PluginId(3), SmConfig::listening().with_dir(&dir).with_name("srv")).unwrap();
    assert!(matches!(
        client("srv").map(|_| ()),
        Err(SmError::NameInUse { .. })
    ));
    drop(first);
    let _again = client("dup").unwrap();

    // Unnamed instances skip a number given as a name.
    let unnamed = || SmPlugin::new(PluginId(4), SmConfig::default().with_dir(&dir)).unwrap();
    let instance = |p: &SmPlugin| p.self_addr().uri().rsplit('-').next().unwrap().to_owned();
    let a = unnamed();
    let next = (instance(&a).parse::<u32>().unwrap() + 1).to_string();
    let _taken = client(&next).unwrap();
    let b = unnamed();
    assert_ne!(instance(&b), next);
    assert_ne!(instance(&b), instance(&a));
    let _ = std::fs::remove_dir_all(&dir);
}
