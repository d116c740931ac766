//! Eight bytes tested at once ("SIMD within a register"), for the SSE encoder's escaper. Each
//! test returns the high bit of every flagged byte of a little-endian word; the lowest flag is
//! always exact (a false one can only sit above a true one, where a borrow carried), so
//! `trailing_zeros() / 8` is the index of the first match.

const ONES: u64 = 0x0101_0101_0101_0101;
const HIGH: u64 = 0x8080_8080_8080_8080;

/// The bytes of `w` equal to `b`.
pub(crate) fn equal(w: u64, b: u8) -> u64 {
    let x = w ^ (ONES * u64::from(b));
    x.wrapping_sub(ONES) & !x & HIGH
}

/// The bytes of `w` below `n` (`n` at most 128).
pub(crate) fn below(w: u64, n: u8) -> u64 {
    w.wrapping_sub(ONES * u64::from(n)) & !w & HIGH
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        /// The first flagged byte is the first matching one, for any word.
        #[test]
        fn the_lowest_flag_is_the_first_match(bytes in proptest::prelude::any::<[u8; 8]>(), b in 0u8..=255, n in 0u8..=128) {
            let w = u64::from_le_bytes(bytes);
            let first = |m: u64| (m != 0).then(|| (m.trailing_zeros() / 8) as usize);
            proptest::prop_assert_eq!(first(equal(w, b)), bytes.iter().position(|&x| x == b));
            proptest::prop_assert_eq!(first(below(w, n)), bytes.iter().position(|&x| x < n));
        }
    }
}
