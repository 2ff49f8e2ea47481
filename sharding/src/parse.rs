//! The parser for XLA's sharding text (`{devices=[2,2]<=[4] last_tile_dim_replicate}`).

use std::str::FromStr;

use crate::hlo::{HloSharding, SubgroupType};
use crate::tile::TileAssignment;
use crate::{Error, Result};

impl FromStr for HloSharding {
    type Err = Error;

    /// Parses XLA's text form. Errors carry the byte offset of the problem.
    fn from_str(s: &str) -> Result<HloSharding> {
        let mut p = Cursor { input: s, pos: 0 };
        let sharding = p.sharding()?;
        p.skip_space();
        if p.pos != s.len() {
            return Err(p.error("end of input"));
        }
        Ok(sharding)
    }
}

/// A position in a text being parsed, with the token helpers both parsers (XLA
/// shardings here, partition specs in `spec.rs`) share.
pub(crate) struct Cursor<'a> {
    pub(crate) input: &'a str,
    pub(crate) pos: usize,
}

impl Cursor<'_> {
    pub(crate) fn error(&self, expected: &'static str) -> Error {
        Error::Parse { input: self.input.to_owned(), position: self.pos, expected }
    }

    fn rest(&self) -> &str {
        &self.input[self.pos..]
    }

    /// Skips whitespace and `/* ... */` comments (XLA prints `/*index=5*/` in tuples).
    pub(crate) fn skip_space(&mut self) {
        loop {
            let input = self.input;
            let trimmed = input[self.pos..].trim_start();
            self.pos = input.len() - trimmed.len();
            if let Some(body) = trimmed.strip_prefix("/*") {
                match body.find("*/") {
                    Some(end) => self.pos += 2 + end + 2,
                    None => return,
                }
            } else {
                return;
            }
        }
    }

    pub(crate) fn eat(&mut self, token: &str) -> bool {
        self.skip_space();
        if self.rest().starts_with(token) {
            self.pos += token.len();
            true
        } else {
            false
        }
    }

    pub(crate) fn expect(&mut self, token: &'static str) -> Result<()> {
        if self.eat(token) { Ok(()) } else { Err(self.error(token)) }
    }

    fn peek(&mut self, token: &str) -> bool {
        self.skip_space();
        self.rest().starts_with(token)
    }

    fn int(&mut self) -> Result<usize> {
        self.skip_space();
        let digits = self.rest().bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 {
            return Err(self.error("a non-negative integer"));
        }
        let value = self.rest()[..digits]
            .parse()
            .map_err(|_| self.error("an integer that fits in a usize"))?;
        self.pos += digits;
        Ok(value)
    }

    /// `i0,i1,...` (at least one).
    fn int_list(&mut self) -> Result<Vec<usize>> {
        let mut values = vec![self.int()?];
        while self.peek(",") && self.comma_then_int() {
            self.pos += 1;
            values.push(self.int()?);
        }
        Ok(values)
    }

    /// Whether a `,` at the cursor is followed by an integer (not the next tuple leaf).
    fn comma_then_int(&self) -> bool {
        self.rest()[1..].trim_start().starts_with(|c: char| c.is_ascii_digit())
    }

    /// `[i0,i1,...]`.
    fn bracketed(&mut self) -> Result<Vec<usize>> {
        self.expect("[")?;
        let values = self.int_list()?;
        self.expect("]")?;
        Ok(values)
    }

    fn sharding(&mut self) -> Result<HloSharding> {
        self.expect("{")?;
        if self.peek("{") || self.peek("}") {
            return self.tuple();
        }
        let sharding = if self.eat("replicated") {
            HloSharding::Replicated
        } else if self.eat("manual") {
            HloSharding::Manual
        } else if self.eat("unreduced") {
            HloSharding::Unreduced
        } else if self.eat("maximal") {
            self.expect("device=")?;
            HloSharding::Maximal { device: self.int()? }
        } else if self.eat("devices=") {
            self.tiled()?
        } else {
            return Err(self.error("`replicated`, `manual`, `unreduced`, `maximal` or `devices=`"));
        };
        self.expect("}")?;
        Ok(sharding)
    }

    fn tuple(&mut self) -> Result<HloSharding> {
        let mut leaves = Vec::new();
        if !self.eat("}") {
            leaves.push(self.sharding()?);
            while self.eat(",") {
                leaves.push(self.sharding()?);
            }
            self.expect("}")?;
        }
        Ok(HloSharding::Tuple(leaves))
    }

    fn tiled(&mut self) -> Result<HloSharding> {
        let start = self.pos;
        let dims = self.bracketed()?;
        let tiles = if self.eat("<=") {
            let reshape = self.bracketed()?;
            let perm = if reshape.len() > 1 || self.peek("T(") {
                self.expect("T(")?;
                let perm = self.int_list()?;
                self.expect(")")?;
                perm
            } else {
                vec![0]
            };
            TileAssignment::iota(dims, &reshape, &perm)
        } else {
            let devices = self.int_list()?;
            TileAssignment::explicit(dims, devices)
        };
        let tiles = tiles.map_err(|e| self.at(start, e))?;
        let mut replicate_last = false;
        let mut subgroups: Option<Vec<SubgroupType>> = None;
        loop {
            if self.eat("last_tile_dim_replicate") {
                replicate_last = true;
            } else if self.eat("last_tile_dims=") {
                self.expect("{")?;
                let mut types = vec![self.subgroup_type()?];
                while self.eat(",") {
                    types.push(self.subgroup_type()?);
                }
                self.expect("}")?;
                subgroups = Some(types);
            } else {
                break;
            }
        }
        match (replicate_last, subgroups) {
            (true, Some(_)) => {
                Err(self.error("only one of last_tile_dim_replicate and last_tile_dims"))
            }
            (true, None) => Ok(HloSharding::partial_tile(tiles)),
            (false, Some(types)) => {
                HloSharding::subgroup(tiles, &types).map_err(|e| self.at(start, e))
            }
            (false, None) => Ok(HloSharding::tile(tiles)),
        }
    }

    fn subgroup_type(&mut self) -> Result<SubgroupType> {
        for t in [SubgroupType::Manual, SubgroupType::Unreduced, SubgroupType::Replicated] {
            if self.eat(t.name()) {
                return Ok(t);
            }
        }
        Err(self.error("`manual`, `unreduced` or `replicated`"))
    }

    /// A semantic error (bad tile counts, not a permutation) found after parsing the
    /// construct that starts at `start`: reported as a parse error at `start`.
    fn at(&self, start: usize, error: Error) -> Error {
        let expected = match error {
            Error::TileCount { .. } => "tile dims whose product equals the number of devices",
            Error::BadTileDims { .. } => "positive tile dims",
            Error::NotAPermutation { .. } => "a device list that is a permutation of 0..n",
            Error::BadTranspose { .. } => "a transpose that permutes the reshape dims",
            Error::TooManySubgroups { .. } => "no more subgroup types than tile dims",
            other => return other,
        };
        Error::Parse { input: self.input.to_owned(), position: start, expected }
    }
}
