//! `torch.save` of a state dict of f32 tensors, written without torch: a zip archive of the
//! pickled `OrderedDict` (protocol 2, the calls torch's own pickle makes: a persistent id per
//! storage and `torch._utils._rebuild_tensor_v2`) and one raw storage per tensor, stored
//! uncompressed, 64-byte aligned, as torch writes them.

use std::io::Write;
use std::path::Path;

/// Pickle protocol-2 opcodes.
const PROTO: u8 = 0x80;
const GLOBAL: u8 = b'c';
const EMPTY_TUPLE: u8 = b')';
const REDUCE: u8 = b'R';
const MARK: u8 = b'(';
const TUPLE: u8 = b't';
const BINUNICODE: u8 = b'X';
const BININT: u8 = b'J';
const BINPERSID: u8 = b'Q';
const NEWFALSE: u8 = 0x89;
const SETITEMS: u8 = b'u';
const STOP: u8 = b'.';

struct Pickle(Vec<u8>);

impl Pickle {
    fn op(&mut self, op: u8) -> &mut Self {
        self.0.push(op);
        self
    }
    fn global(&mut self, module: &str, name: &str) -> &mut Self {
        self.0.push(GLOBAL);
        self.0.extend_from_slice(format!("{module}\n{name}\n").as_bytes());
        self
    }
    fn text(&mut self, s: &str) -> &mut Self {
        self.0.push(BINUNICODE);
        self.0.extend_from_slice(&(s.len() as u32).to_le_bytes());
        self.0.extend_from_slice(s.as_bytes());
        self
    }
    fn int(&mut self, v: usize) -> &mut Self {
        self.0.push(BININT);
        self.0.extend_from_slice(&(v as i32).to_le_bytes());
        self
    }
    fn ints(&mut self, values: &[usize]) -> &mut Self {
        self.op(MARK);
        for &v in values {
            self.int(v);
        }
        self.op(TUPLE)
    }
    fn ordered_dict(&mut self) -> &mut Self {
        self.global("collections", "OrderedDict").op(EMPTY_TUPLE).op(REDUCE)
    }
}

/// Writes `tensors` (name, shape, row-major f32 values) to `path` as `torch.save` would.
pub fn write_torch_save(path: &Path, tensors: &[(String, Vec<usize>, Vec<f32>)]) {
    let mut p = Pickle(Vec::new());
    p.op(PROTO).op(2).ordered_dict().op(MARK);
    for (key, (name, shape, values)) in tensors.iter().enumerate() {
        let strides: Vec<usize> = (0..shape.len()).map(|i| shape[i + 1..].iter().product()).collect();
        p.text(name).global("torch._utils", "_rebuild_tensor_v2").op(MARK);
        // The storage, by persistent id: ('storage', FloatStorage, key, location, numel).
        p.op(MARK)
            .text("storage")
            .global("torch", "FloatStorage")
            .text(&key.to_string())
            .text("cpu")
            .int(values.len())
            .op(TUPLE)
            .op(BINPERSID);
        p.int(0).ints(shape).ints(&strides).op(NEWFALSE).ordered_dict();
        p.op(TUPLE).op(REDUCE);
    }
    p.op(SETITEMS).op(STOP);

    let file = std::fs::File::create(path).expect("create torch.save file");
    let mut zip = zip::ZipWriter::new(file);
    let stored = zip::write::SimpleFileOptions::default()
        .compression_method(zip::CompressionMethod::Stored)
        .with_alignment(64);
    zip.start_file("archive/data.pkl", stored).expect("data.pkl");
    zip.write_all(&p.0).expect("write pickle");
    for (key, (_, _, values)) in tensors.iter().enumerate() {
        zip.start_file(format!("archive/data/{key}"), stored).expect("storage");
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        zip.write_all(&bytes).expect("write storage");
    }
    zip.start_file("archive/version", stored).expect("version");
    zip.write_all(b"3\n").expect("write version");
    zip.finish().expect("finish zip");
}
