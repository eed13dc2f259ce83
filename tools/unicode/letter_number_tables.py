"""Writes src/models/sam3/unicode_classes.rs: the ranges of Unicode's general categories L (letters) and N
(numbers), copied from the tables of the `regex-syntax` crate that HuggingFace tokenizers' regexes use, so
that edgerun's CLIP word splitting sees `\\p{L}` and `\\p{N}` exactly as transformers' tokenizer does.

    python tools/unicode/letter_number_tables.py ~/.cargo/registry/src/*/regex-syntax-0.8.12/src/unicode_tables/general_category.rs
"""
import re
import sys

OUT = "src/models/sam3/unicode_classes.rs"


def table(source, name):
    """The (first, last) code points of table `name` in regex-syntax's general_category.rs."""
    body = re.search(r"pub const %s: &'static \[\(char, char\)\] = &\[(.*?)\];" % name, source, re.S).group(1)
    pairs = re.findall(r"\('((?:\\u\{[0-9a-fA-F]+\})|\\.|[^'])', '((?:\\u\{[0-9a-fA-F]+\})|\\.|[^'])'\)", body)
    return [(code(a), code(b)) for a, b in pairs]


def code(lit):
    """A Rust char literal's code point."""
    if lit.startswith("\\u{"):
        return int(lit[3:-1], 16)
    if lit.startswith("\\"):
        return ord({"n": "\n", "t": "\t", "r": "\r", "0": "\0"}.get(lit[1], lit[1]))
    return ord(lit)


def rust(name, doc, ranges):
    rows = [", ".join("(0x%X, 0x%X)" % r for r in ranges[i:i + 6]) for i in range(0, len(ranges), 6)]
    return "/// %s\npub(crate) const %s: &[(u32, u32)] = &[\n%s\n];\n" % (doc, name, "\n".join("    %s," % r for r in rows))


def main():
    source = open(sys.argv[1]).read()
    version = re.search(r"Unicode version: ([0-9.]+?)\.?\n", source)
    letters, numbers = table(source, "LETTER"), table(source, "NUMBER")
    assert len(letters) > 500 and len(numbers) > 100
    with open(OUT, "w") as f:
        f.write("//! Unicode's letters (`\\p{L}`) and numbers (`\\p{N}`) as ranges of code points, copied from the\n")
        f.write("//! `regex-syntax` crate's tables (Unicode %s) by tools/unicode/letter_number_tables.py. Generated: do not edit.\n\n"
                % (version.group(1) if version else "as that crate has it"))
        f.write(rust("LETTER", "General category L.", letters))
        f.write("\n")
        f.write(rust("NUMBER", "General category N.", numbers))


main()
