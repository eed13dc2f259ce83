//! Bytes and bits of a JPEG stream: a buffered byte source over any reader, and the entropy-coded
//! segment's bit reader (0xFF 0x00 unstuffed; a marker ends the segment, and reading a bit past it
//! is an error — a truncated scan is never filled in).
use std::io::Read;

use super::huffman::Table;

/// Bytes read from the underlying reader at a time.
const CHUNK: usize = 64 << 10;

/// A buffered byte source.
pub(crate) struct Source {
    reader: Box<dyn Read>,
    buf: Vec<u8>,
    pos: usize,
}

impl Source {
    /// Reads from `reader`.
    pub(crate) fn new(reader: Box<dyn Read>) -> Self {
        Source { reader, buf: Vec::new(), pos: 0 }
    }

    /// The next byte; the end of the data is an error.
    pub(crate) fn byte(&mut self) -> Result<u8, String> {
        if self.pos == self.buf.len() {
            self.buf.resize(CHUNK, 0);
            let n = self.reader.read(&mut self.buf).map_err(|e| format!("cannot read the JPEG data: {e}"))?;
            self.buf.truncate(n);
            self.pos = 0;
            if n == 0 {
                return Err("the JPEG data is truncated".into());
            }
        }
        self.pos += 1;
        Ok(self.buf[self.pos - 1])
    }

    /// A big-endian u16.
    pub(crate) fn u16(&mut self) -> Result<u16, String> {
        Ok(u16::from_be_bytes([self.byte()?, self.byte()?]))
    }

    /// The next `n` (< 2^16) bytes.
    pub(crate) fn take(&mut self, n: usize) -> Result<Vec<u8>, String> {
        (0..n).map(|_| self.byte()).collect()
    }
}

/// The bit reader of an entropy-coded segment.
pub(crate) struct Bits {
    acc: u64,
    /// Bits in `acc` (the real ones first).
    n: u32,
    /// A marker met: no more real bits come until it is dealt with.
    pub(crate) marker: Option<u8>,
}

impl Bits {
    /// An empty reader.
    pub(crate) fn new() -> Self {
        Bits { acc: 0, n: 0, marker: None }
    }

    /// Tops the accumulator up to at least 25 bits (zeros after a marker, not counted as real).
    fn fill(&mut self, src: &mut Source) -> Result<(), String> {
        while self.n <= 56 && self.marker.is_none() {
            let mut b = src.byte()?;
            if b == 0xFF {
                let mut m = src.byte()?;
                while m == 0xFF {
                    m = src.byte()?;
                }
                if m != 0 {
                    self.marker = Some(m);
                    break;
                }
                b = 0xFF;
            }
            self.acc |= (b as u64) << (56 - self.n);
            self.n += 8;
        }
        Ok(())
    }

    /// The next `k` (≤ 16) bits as a number.
    pub(crate) fn bits(&mut self, src: &mut Source, k: u32) -> Result<u32, String> {
        if k == 0 {
            return Ok(0);
        }
        if self.n < k {
            self.fill(src)?;
            if self.n < k {
                return Err("the JPEG scan is truncated or corrupt (its data ends inside a block)".into());
            }
        }
        let v = (self.acc >> (64 - k)) as u32;
        self.acc <<= k;
        self.n -= k;
        Ok(v)
    }

    /// Decodes one Huffman symbol.
    pub(crate) fn symbol(&mut self, src: &mut Source, t: &Table) -> Result<u8, String> {
        if self.n < 16 {
            self.fill(src)?;
        }
        let (len, sym) = t.decode((self.acc >> 48) as u16).ok_or("the JPEG scan is corrupt (a bad Huffman code)")?;
        if len > self.n {
            return Err("the JPEG scan is truncated or corrupt (its data ends inside a block)".into());
        }
        self.acc <<= len;
        self.n -= len;
        Ok(sym)
    }

    /// At a restart interval's end: drops the padding bits and reads the RSTn marker.
    pub(crate) fn restart(&mut self, src: &mut Source) -> Result<(), String> {
        if self.marker.is_none() {
            self.acc = 0;
            self.n = 0;
            self.fill(src)?;
        }
        match self.marker.take() {
            Some(0xD0..=0xD7) => {
                self.acc = 0;
                self.n = 0;
                Ok(())
            }
            _ => Err("the JPEG scan is corrupt (a restart marker is missing)".into()),
        }
    }
}

/// The value of `k` bits `v` as a signed coefficient (JPEG's EXTEND).
pub(crate) fn extend(v: u32, k: u32) -> i32 {
    if k == 0 {
        0
    } else if v < 1 << (k - 1) {
        v as i32 - (1 << k) + 1
    } else {
        v as i32
    }
}
