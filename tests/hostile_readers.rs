//! Readers parse, not pattern-match: `.npy` headers as the Python literal they are (sizes checked
//! against the file before reading), and truncated images reported as failed inputs.
use std::io::Write;
use std::path::{Path, PathBuf};

use edgerun::imageio::npy::read_npy_2d;
use edgerun::imageio::{load_rgb, ImageLimits};

fn npy(header: &str, data: &[u8]) -> Vec<u8> {
    let mut h = header.to_string();
    while !(10 + h.len() + 1).is_multiple_of(64) {
        h.push(' ');
    }
    h.push('\n');
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend((h.len() as u16).to_le_bytes());
    out.extend(h.as_bytes());
    out.extend(data);
    out
}

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

#[test]
fn npy_headers_are_parsed_as_python_literals() {
    let dir = tempfile::tempdir().unwrap();
    let d = f32s(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    for ok in [
        "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }",
        "{'shape':(2,3),'descr':'<f4','fortran_order':False}",
        "{ \"fortran_order\" : False ,\t'shape' : ( 2 , 3 , ) , 'descr' : '<f4' }",
    ] {
        let p = write(dir.path(), "ok.npy", &npy(ok, &d));
        assert_eq!(read_npy_2d(&p).unwrap_or_else(|e| panic!("{ok}: {e}")), ((2, 3), vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]));
    }
    // (header, what the error must say)
    let cases: &[(&str, &[u8], &str)] = &[
        ("{'descr':'<f4','fortran_order':True,'shape':(2,3)}", &d, "Fortran"),
        ("{'shape': (2, 3), 'fortran_order':  True, 'descr': '<f4'}", &d, "Fortran"),
        ("{'descr':'<f4','fortran_order':False,'shape':(4294967296,4294967297)}", &d, "overflows"),
        ("{'descr':'<f4','fortran_order':False,'shape':(2147483648,2147483648)}", &d, "overflows"),
        ("{'descr':'<f4','fortran_order':False,'shape':(6,)}", &d, "2-D"),
        ("{'descr':'<f4','fortran_order':False,'shape':()}", &d, "2-D"),
        ("{'descr':'<f4','fortran_order':False,'shape':(6)}", &d, "not a tuple"),
        ("{'descr':'<f4','fortran_order':False,'shape':(2,3),'extra':True}", &d, "unexpected key"),
        ("{'descr':'<f4','fortran_order':False}", &d, "shape"),
        ("{'descr':'>f4','fortran_order':False,'shape':(2,3)}", &d, "little-endian"),
        ("{'descr':'<f8','fortran_order':False,'shape':(2,3)}", &d, "little-endian"),
        ("{'descr':'<f4','fortran_order':False,'shape':(2,3)}", &d[..20], "needs 24"),
        ("{'descr':'<f4','fortran_order':False,'shape':(2,3)}garbage", &d, "after the header"),
        ("{'descr':'<f4','fortran_order':False,'shape':(0,3)}", &[], "empty"),
    ];
    for (h, data, why) in cases {
        let p = write(dir.path(), "bad.npy", &npy(h, data));
        let e = read_npy_2d(&p).expect_err(h).to_string();
        assert!(e.contains(why) && e.contains("bad.npy"), "{h}: {e}");
    }
    let p = write(dir.path(), "short.npy", b"\x93NUMPY\x01\x00\xff\x00{'descr'");
    assert!(read_npy_2d(&p).unwrap_err().to_string().contains("truncated"));
}

#[test]
fn npy_size_is_checked_against_the_file_before_reading() {
    // A 1 TiB sparse file: the header must be looked at, and the size refused, without reading it.
    let dir = tempfile::tempdir().unwrap();
    let p = write(dir.path(), "huge.npy", &npy("{'descr':'<f4','fortran_order':False,'shape':(10,10)}", &[]));
    std::fs::OpenOptions::new().write(true).open(&p).unwrap().set_len(1 << 40).unwrap();
    let t = std::time::Instant::now();
    let e = read_npy_2d(&p).unwrap_err().to_string();
    assert!(e.contains("needs 400"), "{e}");
    assert!(t.elapsed().as_secs() < 5);
}

fn truncated(src: &Path, keep: f64, dir: &Path) -> PathBuf {
    let b = std::fs::read(src).unwrap();
    let p = dir.join(format!("cut_{}", src.file_name().unwrap().to_string_lossy()));
    std::fs::File::create(&p).unwrap().write_all(&b[..(b.len() as f64 * keep) as usize]).unwrap();
    p
}

#[test]
fn truncated_images_are_decode_errors() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let baseline = root.join("examples/images/scene_0.jpg");
    // `jpegtran -progressive -copy none examples/images/scene_0.jpg`: 10 scans.
    let progressive = root.join("tests/fixtures/images/progressive.jpg");
    let png = root.join("examples/images/scene_3.png");
    let dir = tempfile::tempdir().unwrap();
    let limits = ImageLimits::default();
    for src in [&baseline, &progressive, &png] {
        let whole = load_rgb(src, &limits).unwrap_or_else(|e| panic!("{}: {e}", src.display()));
        // Same pixels as the `image` crate gives for the complete file.
        assert_eq!(whole, image::open(src).unwrap().into_rgb8(), "{}", src.display());
        for keep in [0.5, 0.8, 0.97] {
            let cut = truncated(src, keep, dir.path());
            let e = load_rgb(&cut, &limits).expect_err(&format!("{} cut to {keep}", src.display())).to_string();
            assert!(e.contains("cut_"), "{e}");
            // The annotate decode path says the same.
            let enc = edgerun::annotate::decode::read_checked(&cut, &limits).unwrap();
            assert!(edgerun::annotate::decode::decode(&enc, &limits).is_err(), "{} cut to {keep}", src.display());
        }
    }
}
