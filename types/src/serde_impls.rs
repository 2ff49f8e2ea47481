//! Hand-written serde support (feature `serde`): no derive macros in the vocabulary crate.
//!
//! [`DeviceId`] is a number, [`Shape`] a sequence of dims, and [`DType`], [`ReduceOp`]
//! and [`TensorSpec`] their text forms (`"f32"`, `"sum"`, `"f32[8,128]"`), so JSON
//! written by hand or by Python reads naturally.

use std::fmt;
use std::marker::PhantomData;
use std::str::FromStr;

use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::ser::{SerializeSeq, Serializer};
use serde::{Deserialize, Serialize};

use crate::{DType, DeviceId, ReduceOp, Shape, TensorSpec};

impl Serialize for DeviceId {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_u32(self.0)
    }
}

impl<'de> Deserialize<'de> for DeviceId {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        u32::deserialize(deserializer).map(DeviceId)
    }
}

impl Serialize for Shape {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut seq = serializer.serialize_seq(Some(self.rank()))?;
        for d in self.dims() {
            seq.serialize_element(d)?;
        }
        seq.end()
    }
}

impl<'de> Deserialize<'de> for Shape {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct DimsVisitor;
        impl<'de> Visitor<'de> for DimsVisitor {
            type Value = Shape;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a sequence of non-negative dims")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Shape, A::Error> {
                let mut dims = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(64));
                while let Some(d) = seq.next_element::<usize>()? {
                    dims.push(d);
                }
                Shape::try_from(dims).map_err(de::Error::custom)
            }
        }
        deserializer.deserialize_seq(DimsVisitor)
    }
}

/// Serde through `Display` / `FromStr` for the types whose text form is their wire form.
macro_rules! serde_via_text {
    ($($ty:ty => $what:literal),* $(,)?) => {$(
        impl Serialize for $ty {
            fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                serializer.collect_str(self)
            }
        }

        impl<'de> Deserialize<'de> for $ty {
            fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
                deserializer.deserialize_str(TextVisitor::<$ty>(PhantomData, $what))
            }
        }
    )*};
}

serde_via_text!(DType => "a dtype name such as \"f32\"", ReduceOp => "\"sum\", \"mean\", \"min\" or \"max\"", TensorSpec => "a tensor spec such as \"f32[8,128]\"");

struct TextVisitor<T>(PhantomData<T>, &'static str);

impl<T> Visitor<'_> for TextVisitor<T>
where
    T: FromStr,
    T::Err: fmt::Display,
{
    type Value = T;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.1)
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<T, E> {
        v.parse().map_err(E::custom)
    }
}
