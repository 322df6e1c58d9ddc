//! Multi-segment memory handles against a model,
//! and decoding of peer-controlled descriptors.

use na_core::testing::TestRng;
use na_core::{Access, MemHandle, RemoteMem, RemoteSegment};

#[test]
fn multi_segment_read_write_match_a_model() {
    let mut r = TestRng::new(42);
    for round in 0..3000 {
        let nseg = r.below(6) as usize;
        let lens: Vec<usize> = (0..nseg)
            .map(|_| if r.below(3) == 0 { 0 } else { r.below(40) as usize })
            .collect();
        let total: usize = lens.iter().sum();
        let bufs: Vec<Vec<u8>> = lens
            .iter()
            .map(|&l| (0..l).map(|_| r.next_u64() as u8).collect())
            .collect();
        let mut model: Vec<u8> = bufs.concat();
        let h = MemHandle::new(bufs, Access::ReadWrite);
        assert_eq!(h.size() as usize, total);
        for _ in 0..10 {
            let off = r.below(total as u64 + 2);
            let len = r.below(total as u64 + 2);
            let ok = off + len <= total as u64;
            let src: Vec<u8> = (0..len).map(|_| r.next_u64() as u8).collect();
            let w = h.write_at(off, &src);
            assert_eq!(w.is_ok(), ok, "round {round} write {off}+{len} of {total}");
            if ok {
                model[off as usize..(off + len) as usize].copy_from_slice(&src);
            }
            let mut dst = vec![0u8; len as usize];
            assert_eq!(h.read_at(off, &mut dst).is_ok(), ok);
            if ok {
                assert_eq!(&dst[..], &model[off as usize..(off + len) as usize]);
                // Pieces cover exactly the range, in order, never empty.
                let mut sum = 0usize;
                h.for_each_piece(off, len, |_, n| {
                    assert!(n > 0);
                    sum += n;
                })
                .unwrap();
                assert_eq!(sum as u64, len);
            }
        }
        assert_eq!(h.to_vec(), model, "round {round}");
        // Remote descriptor of the same layout walks the same pieces.
        let rm = RemoteMem::of_handle(&h, 7).unwrap();
        let rb = RemoteMem::from_bytes(&rm.to_bytes()).unwrap();
        assert_eq!(rb, rm);
        let off = r.below(total as u64 + 1);
        let len = r.below(total as u64 - off + 1);
        let mut a = Vec::new();
        let mut b = Vec::new();
        h.for_each_piece(off, len, |x, n| a.push((x as u64, n as u64)))
            .unwrap();
        rb.for_each_piece(off, len, |_, x, n| b.push((x, n))).unwrap();
        assert_eq!(a, b);
        assert_eq!(h.into_buffers().unwrap().concat(), model);
    }
}

#[test]
fn descriptor_decoding_never_panics_on_junk() {
    let mut r = TestRng::new(7);
    let base = RemoteMem::new(
        vec![
            RemoteSegment {
                addr: 0x1000,
                len: 10,
                key: 1,
            },
            RemoteSegment {
                addr: 0x9000,
                len: 0,
                key: 2,
            },
            RemoteSegment {
                addr: 0xa000,
                len: 6,
                key: 3,
            },
        ],
        Access::ReadWrite,
    )
    .unwrap()
    .to_bytes();
    for _ in 0..200_000 {
        let mut b = base.clone();
        for _ in 0..=r.below(4) {
            let i = r.below(b.len() as u64) as usize;
            b[i] = r.next_u64() as u8;
        }
        if r.below(4) == 0 {
            b.truncate(r.below(b.len() as u64 + 1) as usize);
        }
        if let Ok(m) = RemoteMem::from_bytes(&b) {
            // Whatever decodes must be internally consistent.
            let sum: u64 = m.segments().iter().map(|s| s.len).sum();
            assert_eq!(sum, m.size());
            for s in m.segments() {
                assert!(s.addr.checked_add(s.len).is_some());
            }
            let _ = m.for_each_piece(m.size() / 2, m.size() - m.size() / 2, |_, _, _| {});
            assert!(m.check_range(u64::MAX, 1).is_err());
        }
    }
    // Maximum segment count, exactly, decodes; one more does not.
    let segs = vec![
        RemoteSegment {
            addr: 0,
            len: 0,
            key: 0
        };
        na_core::MAX_REMOTE_SEGMENTS
    ];
    let m = RemoteMem::new(segs, Access::ReadOnly).unwrap();
    assert!(RemoteMem::from_bytes(&m.to_bytes()).is_ok());
    let mut over = m.to_bytes();
    over[4..8].copy_from_slice(&((na_core::MAX_REMOTE_SEGMENTS as u32) + 1).to_le_bytes());
    over.extend_from_slice(&[0u8; 24]);
    assert!(RemoteMem::from_bytes(&over).is_err());
}
