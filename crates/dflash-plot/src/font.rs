//! A built-in 5×9 bitmap font for ASCII 32..=126, drawn at integer scale factors.
//!
//! Each glyph is 5 pixels wide and 9 tall: rows 0..=6 hold capitals and digits (the baseline is
//! under row 6), rows 2..=6 are the lowercase x-height, and rows 7..=8 hold descenders
//! (`g j p q y`, `,` `_`). A character cell is [`CELL_W`] × [`CELL_H`] pixels at scale 1 (one
//! blank column of spacing on the right); bytes outside 32..=126 are drawn as `?`.
//!
//! The glyph shapes are written below as text (`#` = ink, `.` = blank, rows separated by
//! spaces, top row first) and packed into bit rows at compile time; a malformed entry is a
//! compile error, not a runtime panic.

use crate::raster::{Canvas, Rgb};

/// Glyph width in pixels at scale 1.
pub const GLYPH_W: u32 = 5;
/// Glyph height in pixels at scale 1 (cap height 7 plus a 2-row descender).
pub const GLYPH_H: u32 = 9;
/// Horizontal advance per character at scale 1.
pub const CELL_W: u32 = GLYPH_W + 1;
/// Line height at scale 1.
pub const CELL_H: u32 = GLYPH_H;
/// Height of capitals and digits at scale 1 (the part of the cell above the baseline).
pub const CAP_H: u32 = 7;

const FIRST: u8 = 32;
const COUNT: usize = 95;

/// Glyph art for ASCII 32..=126, in order. Nine rows of five columns each.
const ART: [&str; COUNT] = [
    "..... ..... ..... ..... ..... ..... ..... ..... .....", // ' '
    "..#.. ..#.. ..#.. ..#.. ..#.. ..... ..#.. ..... .....", // !
    ".#.#. .#.#. .#.#. ..... ..... ..... ..... ..... .....", // "
    ".#.#. .#.#. ##### .#.#. ##### .#.#. .#.#. ..... .....", // #
    "..#.. .#### #.#.. .###. ..#.# ####. ..#.. ..... .....", // $
    "##... ##..# ...#. ..#.. .#... #..## ...## ..... .....", // %
    ".##.. #..#. #.#.. .#... #.#.# #..#. .##.# ..... .....", // &
    "..#.. ..#.. .#... ..... ..... ..... ..... ..... .....", // '
    "...#. ..#.. .#... .#... .#... ..#.. ...#. ..... .....", // (
    ".#... ..#.. ...#. ...#. ...#. ..#.. .#... ..... .....", // )
    "..... ..#.. #.#.# .###. #.#.# ..#.. ..... ..... .....", // *
    "..... ..#.. ..#.. ##### ..#.. ..#.. ..... ..... .....", // +
    "..... ..... ..... ..... ..... .##.. ..#.. .#... .....", // ,
    "..... ..... ..... ##### ..... ..... ..... ..... .....", // -
    "..... ..... ..... ..... ..... .##.. .##.. ..... .....", // .
    "....# ....# ...#. ..#.. .#... #.... #.... ..... .....", // /
    ".###. #...# #..## #.#.# ##..# #...# .###. ..... .....", // 0
    "..#.. .##.. ..#.. ..#.. ..#.. ..#.. .###. ..... .....", // 1
    ".###. #...# ....# ...#. ..#.. .#... ##### ..... .....", // 2
    "##### ...#. ..#.. ...#. ....# #...# .###. ..... .....", // 3
    "...#. ..##. .#.#. #..#. ##### ...#. ...#. ..... .....", // 4
    "##### #.... ####. ....# ....# #...# .###. ..... .....", // 5
    "..##. .#... #.... ####. #...# #...# .###. ..... .....", // 6
    "##### ....# ...#. ..#.. .#... .#... .#... ..... .....", // 7
    ".###. #...# #...# .###. #...# #...# .###. ..... .....", // 8
    ".###. #...# #...# .#### ....# ...#. .##.. ..... .....", // 9
    "..... .##.. .##.. ..... .##.. .##.. ..... ..... .....", // :
    "..... .##.. .##.. ..... .##.. ..#.. .#... ..... .....", // ;
    "...#. ..#.. .#... #.... .#... ..#.. ...#. ..... .....", // <
    "..... ..... ##### ..... ##### ..... ..... ..... .....", // =
    ".#... ..#.. ...#. ....# ...#. ..#.. .#... ..... .....", // >
    ".###. #...# ....# ...#. ..#.. ..... ..#.. ..... .....", // ?
    ".###. #...# #.### #.#.# #.### #.... .###. ..... .....", // @
    ".###. #...# #...# ##### #...# #...# #...# ..... .....", // A
    "####. #...# #...# ####. #...# #...# ####. ..... .....", // B
    ".###. #...# #.... #.... #.... #...# .###. ..... .....", // C
    "####. #...# #...# #...# #...# #...# ####. ..... .....", // D
    "##### #.... #.... ####. #.... #.... ##### ..... .....", // E
    "##### #.... #.... ####. #.... #.... #.... ..... .....", // F
    ".###. #...# #.... #.### #...# #...# .#### ..... .....", // G
    "#...# #...# #...# ##### #...# #...# #...# ..... .....", // H
    ".###. ..#.. ..#.. ..#.. ..#.. ..#.. .###. ..... .....", // I
    "..### ...#. ...#. ...#. ...#. #..#. .##.. ..... .....", // J
    "#...# #..#. #.#.. ##... #.#.. #..#. #...# ..... .....", // K
    "#.... #.... #.... #.... #.... #.... ##### ..... .....", // L
    "#...# ##.## #.#.# #.#.# #...# #...# #...# ..... .....", // M
    "#...# #...# ##..# #.#.# #..## #...# #...# ..... .....", // N
    ".###. #...# #...# #...# #...# #...# .###. ..... .....", // O
    "####. #...# #...# ####. #.... #.... #.... ..... .....", // P
    ".###. #...# #...# #...# #.#.# #..#. .##.# ..... .....", // Q
    "####. #...# #...# ####. #.#.. #..#. #...# ..... .....", // R
    ".#### #.... #.... .###. ....# ....# ####. ..... .....", // S
    "##### ..#.. ..#.. ..#.. ..#.. ..#.. ..#.. ..... .....", // T
    "#...# #...# #...# #...# #...# #...# .###. ..... .....", // U
    "#...# #...# #...# #...# #...# .#.#. ..#.. ..... .....", // V
    "#...# #...# #...# #.#.# #.#.# #.#.# .#.#. ..... .....", // W
    "#...# #...# .#.#. ..#.. .#.#. #...# #...# ..... .....", // X
    "#...# #...# .#.#. ..#.. ..#.. ..#.. ..#.. ..... .....", // Y
    "##### ....# ...#. ..#.. .#... #.... ##### ..... .....", // Z
    ".###. .#... .#... .#... .#... .#... .###. ..... .....", // [
    "#.... #.... .#... ..#.. ...#. ....# ....# ..... .....", // backslash
    ".###. ...#. ...#. ...#. ...#. ...#. .###. ..... .....", // ]
    "..#.. .#.#. #...# ..... ..... ..... ..... ..... .....", // ^
    "..... ..... ..... ..... ..... ..... ..... ##### .....", // _
    ".#... ..#.. ...#. ..... ..... ..... ..... ..... .....", // `
    "..... ..... .###. ....# .#### #...# .#### ..... .....", // a
    "#.... #.... ####. #...# #...# #...# ####. ..... .....", // b
    "..... ..... .###. #.... #.... #...# .###. ..... .....", // c
    "....# ....# .#### #...# #...# #...# .#### ..... .....", // d
    "..... ..... .###. #...# ##### #.... .###. ..... .....", // e
    "..##. .#..# .#... ###.. .#... .#... .#... ..... .....", // f
    "..... ..... .#### #...# #...# #...# .#### ....# .###.", // g
    "#.... #.... #.##. ##..# #...# #...# #...# ..... .....", // h
    "..#.. ..... .##.. ..#.. ..#.. ..#.. .###. ..... .....", // i
    "...#. ..... ..##. ...#. ...#. ...#. ...#. #..#. .##..", // j
    "#.... #.... #..#. #.#.. ##... #.#.. #..#. ..... .....", // k
    ".##.. ..#.. ..#.. ..#.. ..#.. ..#.. .###. ..... .....", // l
    "..... ..... ##.#. #.#.# #.#.# #.#.# #.#.# ..... .....", // m
    "..... ..... #.##. ##..# #...# #...# #...# ..... .....", // n
    "..... ..... .###. #...# #...# #...# .###. ..... .....", // o
    "..... ..... ####. #...# #...# #...# ####. #.... #....", // p
    "..... ..... .#### #...# #...# #...# .#### ....# ....#", // q
    "..... ..... #.##. ##..# #.... #.... #.... ..... .....", // r
    "..... ..... .#### #.... .###. ....# ####. ..... .....", // s
    ".#... .#... ###.. .#... .#... .#..# ..##. ..... .....", // t
    "..... ..... #...# #...# #...# #..## .##.# ..... .....", // u
    "..... ..... #...# #...# #...# .#.#. ..#.. ..... .....", // v
    "..... ..... #...# #...# #.#.# #.#.# .#.#. ..... .....", // w
    "..... ..... #...# .#.#. ..#.. .#.#. #...# ..... .....", // x
    "..... ..... #...# #...# #...# #...# .#### ....# .###.", // y
    "..... ..... ##### ...#. ..#.. .#... ##### ..... .....", // z
    "...## ..#.. ..#.. .#... ..#.. ..#.. ...## ..... .....", // {
    "..#.. ..#.. ..#.. ..#.. ..#.. ..#.. ..#.. ..#.. .....", // |
    "##... ..#.. ..#.. ...#. ..#.. ..#.. ##... ..... .....", // }
    "..... ..... .#... #.#.# ...#. ..... ..... ..... .....", // ~
];

/// Packs one art string into nine bit rows (bit 4 = leftmost column).
const fn pack(art: &str) -> [u8; GLYPH_H as usize] {
    let b = art.as_bytes();
    assert!(
        b.len() == 9 * 6 - 1,
        "glyph art must be 9 rows of 5 columns"
    );
    let mut rows = [0u8; GLYPH_H as usize];
    let mut r = 0;
    while r < GLYPH_H as usize {
        let mut c = 0;
        while c < GLYPH_W as usize {
            let ch = b[r * 6 + c];
            assert!(
                ch == b'#' || ch == b'.',
                "glyph art may only hold '#' and '.'"
            );
            if ch == b'#' {
                rows[r] |= 1 << (GLYPH_W as usize - 1 - c);
            }
            c += 1;
        }
        if r + 1 < GLYPH_H as usize {
            assert!(
                b[r * 6 + 5] == b' ',
                "glyph rows are separated by one space"
            );
        }
        r += 1;
    }
    rows
}

const fn pack_all() -> [[u8; GLYPH_H as usize]; COUNT] {
    let mut out = [[0u8; GLYPH_H as usize]; COUNT];
    let mut i = 0;
    while i < COUNT {
        out[i] = pack(ART[i]);
        i += 1;
    }
    out
}

/// Packed glyph bit rows, indexed by `byte - 32`.
static GLYPHS: [[u8; GLYPH_H as usize]; COUNT] = pack_all();

/// The bit rows of the glyph for `c` (non-printable or non-ASCII characters map to `?`).
pub fn glyph(c: char) -> &'static [u8; GLYPH_H as usize] {
    let code = c as u32;
    let idx = if (FIRST as u32..FIRST as u32 + COUNT as u32).contains(&code) {
        (code - FIRST as u32) as usize
    } else {
        (b'?' - FIRST) as usize
    };
    &GLYPHS[idx]
}

/// Width in pixels of `text` drawn at `scale` (no trailing spacing column).
pub fn text_width(text: &str, scale: u32) -> u32 {
    let n = text.chars().count() as u32;
    if n == 0 {
        0
    } else {
        (n * CELL_W - 1) * scale
    }
}

/// Draws `text` left to right with the top-left corner of its first cell at `(x, y)`.
pub fn draw_text(canvas: &mut Canvas, x: i64, y: i64, text: &str, scale: u32, color: Rgb) {
    draw_impl(canvas, text, scale, |tx, ty| (x + tx, y + ty), color);
}

/// Draws `text` rotated 90° counter-clockwise (reading bottom to top). `(x, y)` is the
/// bottom-left corner of the rotated run: the glyph tops face left, towards `x`.
pub fn draw_text_up(canvas: &mut Canvas, x: i64, y: i64, text: &str, scale: u32, color: Rgb) {
    draw_impl(canvas, text, scale, |tx, ty| (x + ty, y - 1 - tx), color);
}

/// Shared glyph walker: `map` turns unrotated text-space pixel coordinates into canvas ones.
fn draw_impl(
    canvas: &mut Canvas,
    text: &str,
    scale: u32,
    map: impl Fn(i64, i64) -> (i64, i64),
    color: Rgb,
) {
    let s = scale.max(1) as i64;
    for (i, c) in text.chars().enumerate() {
        let rows = glyph(c);
        let ox = i as i64 * CELL_W as i64 * s;
        for (r, bits) in rows.iter().enumerate() {
            for col in 0..GLYPH_W as i64 {
                if bits & (1 << (GLYPH_W as i64 - 1 - col)) == 0 {
                    continue;
                }
                for dy in 0..s {
                    for dx in 0..s {
                        let (px, py) = map(ox + col * s + dx, r as i64 * s + dy);
                        canvas.put(px, py, color);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_printable_glyph_but_space_has_ink() {
        for code in 33u8..=126 {
            let rows = glyph(code as char);
            assert!(
                rows.iter().any(|&r| r != 0),
                "glyph {:?} is blank",
                code as char
            );
        }
        assert!(glyph(' ').iter().all(|&r| r == 0));
    }

    #[test]
    fn glyphs_are_distinct() {
        for a in 32u8..=126 {
            for b in (a + 1)..=126 {
                assert_ne!(
                    glyph(a as char),
                    glyph(b as char),
                    "{:?} == {:?}",
                    a as char,
                    b as char
                );
            }
        }
    }

    #[test]
    fn unknown_chars_fall_back_to_question_mark() {
        assert_eq!(glyph('é'), glyph('?'));
        assert_eq!(glyph('\n'), glyph('?'));
    }

    #[test]
    fn text_width_scales() {
        assert_eq!(text_width("", 2), 0);
        assert_eq!(text_width("a", 1), 5);
        assert_eq!(text_width("ab", 1), 11);
        assert_eq!(text_width("ab", 3), 33);
    }

    #[test]
    fn drawn_text_stays_in_its_box() {
        let mut c = Canvas::new(40, 30, Rgb::WHITE);
        draw_text(&mut c, 2, 3, "Ag", 2, Rgb::BLACK);
        let (mut minx, mut miny, mut maxx, mut maxy) = (u32::MAX, u32::MAX, 0, 0);
        for y in 0..30 {
            for x in 0..40 {
                if c.get(x, y) == Some(Rgb::BLACK) {
                    minx = minx.min(x);
                    miny = miny.min(y);
                    maxx = maxx.max(x);
                    maxy = maxy.max(y);
                }
            }
        }
        assert!(minx >= 2 && miny >= 3);
        assert!(maxx < 2 + text_width("Ag", 2));
        assert!(maxy < 3 + CELL_H * 2);
        // 'g' has a descender, so ink reaches below the cap height.
        assert!(maxy >= 3 + CAP_H * 2);
    }
}
