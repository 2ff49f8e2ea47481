//! serde support (feature `serde`): XLA shardings and partition specs travel as their
//! text forms; meshes, named shardings and bound shardings as small objects whose
//! fields match the JAX oracle's (`shape`, `axis_names`, `axis_types`, `device_ids`).
//! Deserialising validates exactly as the constructors do.

use std::fmt;
use std::marker::PhantomData;
use std::str::FromStr;

use meshwork_types::DeviceId;
use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serialize, Serializer};

use crate::{AxisType, Error, HloSharding, Mesh, NamedSharding, PartitionSpec, Sharding};

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

serde_via_text!(
    HloSharding => "an XLA sharding such as \"{devices=[2,2]<=[4]}\"",
    PartitionSpec => "a partition spec such as \"P('a', None)\"",
);

struct TextVisitor<T>(PhantomData<T>, &'static str);

impl<T: FromStr<Err = Error>> Visitor<'_> for TextVisitor<T> {
    type Value = T;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.1)
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<T, E> {
        v.parse().map_err(E::custom)
    }
}

impl Serialize for AxisType {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for AxisType {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        match String::deserialize(deserializer)?.as_str() {
            "Auto" => Ok(AxisType::Auto),
            "Explicit" => Ok(AxisType::Explicit),
            "Manual" => Ok(AxisType::Manual),
            other => Err(de::Error::unknown_variant(other, &["Auto", "Explicit", "Manual"])),
        }
    }
}

#[derive(Serialize, Deserialize)]
struct MeshRepr {
    shape: Vec<usize>,
    axis_names: Vec<String>,
    #[serde(default)]
    axis_types: Option<Vec<AxisType>>,
    device_ids: Vec<DeviceId>,
}

impl Serialize for Mesh {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        MeshRepr {
            shape: self.shape().to_vec(),
            axis_names: self.axis_names().to_vec(),
            axis_types: Some(self.axis_types().to_vec()),
            device_ids: self.devices().to_vec(),
        }
        .serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for Mesh {
    /// `axis_types` may be left out (every axis Auto).
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let repr = MeshRepr::deserialize(deserializer)?;
        let types = repr.axis_types.unwrap_or_else(|| vec![AxisType::Auto; repr.shape.len()]);
        Mesh::with_types(repr.axis_names, repr.shape, types, repr.device_ids)
            .map_err(de::Error::custom)
    }
}

#[derive(Serialize, Deserialize)]
struct NamedRepr {
    mesh: Mesh,
    spec: PartitionSpec,
}

impl Serialize for NamedSharding {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        NamedRepr { mesh: self.mesh().clone(), spec: self.spec().clone() }.serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for NamedSharding {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let repr = NamedRepr::deserialize(deserializer)?;
        NamedSharding::new(repr.mesh, repr.spec).map_err(de::Error::custom)
    }
}

#[derive(Serialize, Deserialize)]
struct ShardingRepr {
    hlo: HloSharding,
    device_assignment: Vec<DeviceId>,
}

impl Serialize for Sharding {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        ShardingRepr {
            hlo: self.hlo().clone(),
            device_assignment: self.device_assignment().to_vec(),
        }
        .serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for Sharding {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let repr = ShardingRepr::deserialize(deserializer)?;
        Sharding::new(repr.hlo, repr.device_assignment).map_err(de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::testing::{hlo_sharding, named_sharding};

    fn roundtrip<T: Serialize + de::DeserializeOwned + PartialEq + fmt::Debug>(
        value: &T,
    ) -> String {
        let json = serde_json::to_string(value).unwrap();
        let back: T = serde_json::from_str(&json).unwrap_or_else(|e| panic!("{json}: {e}"));
        assert_eq!(&back, value, "{json}");
        json
    }

    proptest! {
        #[test]
        fn prop_serde_roundtrip(named in (0..=3usize).prop_flat_map(named_sharding), hlo in hlo_sharding()) {
            roundtrip(&named);
            prop_assert_eq!(roundtrip(named.spec()), format!("\"{}\"", named.spec()));
            prop_assert_eq!(roundtrip(&hlo), format!("\"{hlo}\""));
            let rank = named.spec().dims().len();
            roundtrip(&named.to_sharding(rank)?);
        }
    }

    #[test]
    fn oracle_mesh_objects_read_and_bad_ones_are_refused() {
        let mesh: Mesh = serde_json::from_str(
            r#"{"shape": [2, 2], "axis_names": ["a", "b"], "axis_types": ["Auto", "Explicit"], "device_ids": [3, 2, 1, 0]}"#,
        )
        .unwrap();
        assert_eq!(mesh.axis_types(), [AxisType::Auto, AxisType::Explicit]);
        let err = serde_json::from_str::<Mesh>(
            r#"{"shape": [2], "axis_names": ["a"], "device_ids": [1, 1]}"#,
        )
        .unwrap_err();
        assert!(err.to_string().contains("device 1 appears twice"), "{err}");
        let err = serde_json::from_str::<HloSharding>(r#""{devices=[2,2]<=[2,2]}""#).unwrap_err();
        assert!(err.to_string().contains("expected T("), "{err}");
        let err = serde_json::from_str::<NamedSharding>(
            r#"{"mesh": {"shape": [2], "axis_names": ["a"], "device_ids": [0, 1]}, "spec": "P('b')"}"#,
        )
        .unwrap_err();
        assert!(err.to_string().contains("axis `b`"), "{err}");
    }
}
