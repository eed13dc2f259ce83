//! The `.npy` header: a Python dict literal with exactly the keys `descr`, `fortran_order` and
//! `shape`, parsed as such (any key order and spacing, trailing commas, `True`/`False`, tuples
//! including `(3,)` and `()`), never pattern-matched.

/// The element types edgerun reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NpyDtype {
    /// Little-endian IEEE half (`<f2`).
    F16,
    /// Little-endian IEEE single (`<f4`).
    F32,
}

impl NpyDtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            NpyDtype::F16 => 2,
            NpyDtype::F32 => 4,
        }
    }
}

/// A parsed `.npy` header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NpyHeader {
    /// Element type.
    pub dtype: NpyDtype,
    /// Whether the data is in Fortran (column-major) order.
    pub fortran_order: bool,
    /// Dimensions.
    pub shape: Vec<usize>,
}

impl NpyHeader {
    /// The element count, or an error when the product of the dimensions overflows.
    pub fn elements(&self) -> Result<usize, String> {
        self.shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d)).ok_or_else(|| format!("shape {:?} overflows", self.shape))
    }

    /// The data size in bytes, or an error when it overflows.
    pub(crate) fn data_bytes(&self) -> Result<usize, String> {
        self.elements()?.checked_mul(self.dtype.size()).ok_or_else(|| format!("shape {:?} overflows", self.shape))
    }
}

/// Most dimensions accepted in a shape.
const MAX_RANK: usize = 32;

/// A literal value of the header dict.
enum Value {
    Str(String),
    Bool(bool),
    Tuple(Vec<usize>),
}

struct Parser<'a> {
    s: &'a [u8],
    pos: usize,
}

impl Parser<'_> {
    fn ws(&mut self) {
        while self.pos < self.s.len() && matches!(self.s[self.pos], b' ' | b'\t' | b'\n' | b'\r') {
            self.pos += 1;
        }
    }

    fn peek(&mut self) -> Option<u8> {
        self.ws();
        self.s.get(self.pos).copied()
    }

    fn eat(&mut self, c: u8) -> bool {
        if self.peek() == Some(c) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    fn expect(&mut self, c: u8) -> Result<(), String> {
        if self.eat(c) {
            Ok(())
        } else {
            Err(format!("expected `{}` at byte {}", c as char, self.pos))
        }
    }

    fn string(&mut self) -> Result<String, String> {
        let q = match self.peek() {
            Some(q @ (b'\'' | b'"')) => q,
            _ => return Err(format!("expected a string at byte {}", self.pos)),
        };
        self.pos += 1;
        let start = self.pos;
        while self.pos < self.s.len() && self.s[self.pos] != q {
            if self.s[self.pos] == b'\\' || self.s[self.pos] == b'\n' {
                return Err("escapes and line breaks in strings are not supported".into());
            }
            self.pos += 1;
        }
        if self.pos >= self.s.len() {
            return Err("unterminated string".into());
        }
        let out = String::from_utf8_lossy(&self.s[start..self.pos]).into_owned();
        self.pos += 1;
        Ok(out)
    }

    fn int(&mut self) -> Result<usize, String> {
        self.ws();
        let start = self.pos;
        while self.pos < self.s.len() && self.s[self.pos].is_ascii_digit() {
            self.pos += 1;
        }
        if start == self.pos {
            return Err(format!("expected a non-negative integer at byte {start}"));
        }
        let digits = std::str::from_utf8(&self.s[start..self.pos]).map_err(|e| e.to_string())?;
        // Python 2 wrote longs as `3L`.
        if self.s.get(self.pos) == Some(&b'L') {
            self.pos += 1;
        }
        digits.parse::<usize>().map_err(|_| format!("dimension {digits} is too large"))
    }

    fn tuple(&mut self) -> Result<Vec<usize>, String> {
        self.expect(b'(')?;
        let mut dims = Vec::new();
        let mut commas = 0;
        loop {
            if self.eat(b')') {
                break;
            }
            dims.push(self.int()?);
            if dims.len() > MAX_RANK {
                return Err(format!("more than {MAX_RANK} dimensions"));
            }
            if self.eat(b',') {
                commas += 1;
            } else {
                self.expect(b')')?;
                break;
            }
        }
        // `(3)` is the integer 3 in Python, not a tuple.
        if dims.len() == 1 && commas == 0 {
            return Err("shape `(n)` is not a tuple (write `(n,)`)".into());
        }
        Ok(dims)
    }

    fn word(&mut self, w: &str) -> bool {
        self.ws();
        let end = self.pos + w.len();
        let follows_ident = self.s.get(end).is_some_and(|c| c.is_ascii_alphanumeric() || *c == b'_');
        if self.s.get(self.pos..end) == Some(w.as_bytes()) && !follows_ident {
            self.pos = end;
            true
        } else {
            false
        }
    }

    fn value(&mut self) -> Result<Value, String> {
        match self.peek() {
            Some(b'\'' | b'"') => Ok(Value::Str(self.string()?)),
            Some(b'(') => Ok(Value::Tuple(self.tuple()?)),
            _ if self.word("True") => Ok(Value::Bool(true)),
            _ if self.word("False") => Ok(Value::Bool(false)),
            _ => Err(format!("unsupported value at byte {}", self.pos)),
        }
    }
}

/// Parses the header text (the dict literal, padding and the final newline included).
pub fn parse_header(text: &[u8]) -> Result<NpyHeader, String> {
    let mut p = Parser { s: text, pos: 0 };
    p.expect(b'{')?;
    let (mut descr, mut fortran, mut shape) = (None, None, None);
    loop {
        if p.eat(b'}') {
            break;
        }
        let key = p.string()?;
        p.expect(b':')?;
        let v = p.value()?;
        let dup = match (key.as_str(), v) {
            ("descr", Value::Str(s)) => descr.replace(s).is_some(),
            ("fortran_order", Value::Bool(b)) => fortran.replace(b).is_some(),
            ("shape", Value::Tuple(t)) => shape.replace(t).is_some(),
            ("descr" | "fortran_order" | "shape", _) => return Err(format!("`{key}` has the wrong type")),
            (other, _) => return Err(format!("unexpected key `{other}`")),
        };
        if dup {
            return Err(format!("key `{key}` appears twice"));
        }
        if !p.eat(b',') {
            p.expect(b'}')?;
            break;
        }
    }
    if p.peek().is_some() {
        return Err(format!("unexpected text after the header dict at byte {}", p.pos));
    }
    let descr = descr.ok_or("no `descr` key")?;
    let dtype = match descr.as_str() {
        "<f2" => NpyDtype::F16,
        "<f4" => NpyDtype::F32,
        o => return Err(format!("dtype `{o}`: only little-endian float16/float32 (`<f2`, `<f4`) are supported")),
    };
    Ok(NpyHeader { dtype, fortran_order: fortran.ok_or("no `fortran_order` key")?, shape: shape.ok_or("no `shape` key")? })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_any_spacing_and_order() {
        let h = parse_header(b"{'shape':(3,4),'fortran_order':True,'descr':'<f2'}\n").unwrap();
        assert_eq!(h, NpyHeader { dtype: NpyDtype::F16, fortran_order: true, shape: vec![3, 4] });
        let h = parse_header(b"{ \"descr\" : \"<f4\" ,\n 'fortran_order': False, 'shape': (), }   \n").unwrap();
        assert_eq!((h.shape.len(), h.elements().unwrap()), (0, 1));
        assert_eq!(parse_header(b"{'descr':'<f4','fortran_order':False,'shape':(7,)}").unwrap().shape, vec![7]);
        for bad in [
            &b"{'descr':'<f4','fortran_order':False,'shape':(7)}"[..],
            b"{'descr':'<f4','fortran_order':False}",
            b"{'descr':'<f4','fortran_order':Falsey,'shape':()}",
            b"{'descr':'<f4','fortran_order':False,'shape':(),'x':1}",
            b"{'descr':'<f4','descr':'<f4','fortran_order':False,'shape':()}",
            b"{'descr':'>f4','fortran_order':False,'shape':()}",
            b"{'descr':'<f4','fortran_order':False,'shape':(-1,)}",
            b"{'descr':'<f4','fortran_order':False,'shape':()} x",
        ] {
            assert!(parse_header(bad).is_err(), "{}", String::from_utf8_lossy(bad));
        }
        let big = parse_header(b"{'descr':'<f4','fortran_order':False,'shape':(4294967296,4294967296)}").unwrap();
        assert!(big.elements().is_err());
    }
}
