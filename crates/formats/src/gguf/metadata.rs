//! The key/value metadata of a GGUF file, with typed accessors for model code.
//!
//! Model code reads hyperparameters such as `llama.embedding_length` from here. Integer accessors accept
//! any of the eight integer types as long as the value fits the requested type, because converters do not
//! agree on widths (some write u64 where others write u32); float and string accessors are strict.

use std::collections::HashMap;

use super::value::{MetadataArray, MetadataValue};
use crate::error::FormatError;

/// Ordered key/value metadata (file order is kept for listing and for writing back).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Metadata {
    entries: Vec<(String, MetadataValue)>,
    index: HashMap<String, usize>,
}

/// A type that a metadata value can be read as.
pub trait FromMetadata<'a>: Sized {
    /// What the accessor expected, for error messages.
    const EXPECTED: &'static str;
    fn from_value(value: &'a MetadataValue) -> Option<Self>;
}

macro_rules! int_from_metadata {
    ($($t:ty),*) => {
        $(
            impl FromMetadata<'_> for $t {
                const EXPECTED: &'static str = concat!("an integer that fits ", stringify!($t));
                fn from_value(value: &MetadataValue) -> Option<Self> {
                    value.as_i128().and_then(|v| <$t>::try_from(v).ok())
                }
            }
        )*
    };
}
int_from_metadata!(u8, i8, u16, i16, u32, i32, u64, i64, usize);

impl FromMetadata<'_> for f32 {
    const EXPECTED: &'static str = "f32";
    fn from_value(value: &MetadataValue) -> Option<Self> {
        match *value {
            MetadataValue::F32(v) => Some(v),
            _ => None,
        }
    }
}

impl FromMetadata<'_> for f64 {
    const EXPECTED: &'static str = "f32 or f64";
    fn from_value(value: &MetadataValue) -> Option<Self> {
        match *value {
            MetadataValue::F32(v) => Some(v.into()),
            MetadataValue::F64(v) => Some(v),
            _ => None,
        }
    }
}

impl FromMetadata<'_> for bool {
    const EXPECTED: &'static str = "bool";
    fn from_value(value: &MetadataValue) -> Option<Self> {
        match *value {
            MetadataValue::Bool(v) => Some(v),
            _ => None,
        }
    }
}

impl<'a> FromMetadata<'a> for &'a str {
    const EXPECTED: &'static str = "string";
    fn from_value(value: &'a MetadataValue) -> Option<Self> {
        value.as_str()
    }
}

impl<'a> FromMetadata<'a> for &'a MetadataArray {
    const EXPECTED: &'static str = "array";
    fn from_value(value: &'a MetadataValue) -> Option<Self> {
        value.as_array()
    }
}

macro_rules! slice_from_metadata {
    ($($t:ty => $variant:ident),*) => {
        $(
            impl<'a> FromMetadata<'a> for &'a [$t] {
                const EXPECTED: &'static str = concat!("array of ", stringify!($t));
                fn from_value(value: &'a MetadataValue) -> Option<Self> {
                    match value {
                        MetadataValue::Array(MetadataArray::$variant(v)) => Some(v.as_slice()),
                        _ => None,
                    }
                }
            }
        )*
    };
}
slice_from_metadata!(
    u8 => U8, i8 => I8, u16 => U16, i16 => I16, u32 => U32, i32 => I32, u64 => U64, i64 => I64,
    f32 => F32, f64 => F64, bool => Bool, String => String
);

impl Metadata {
    pub fn new() -> Self {
        Self::default()
    }

    /// Room for `n` entries without reallocation (the reader knows the count up front).
    pub fn with_capacity(n: usize) -> Self {
        Metadata {
            entries: Vec::with_capacity(n),
            index: HashMap::with_capacity(n),
        }
    }

    /// Adds a key; returns the value back as the error if the key is already present.
    pub fn insert(
        &mut self,
        key: impl Into<String>,
        value: impl Into<MetadataValue>,
    ) -> Result<(), MetadataValue> {
        let key = key.into();
        let value = value.into();
        if self.index.contains_key(&key) {
            return Err(value);
        }
        self.index.insert(key.clone(), self.entries.len());
        self.entries.push((key, value));
        Ok(())
    }

    /// Sets a key, replacing any previous value in place (keeping its position).
    pub fn set(&mut self, key: impl Into<String>, value: impl Into<MetadataValue>) {
        let key = key.into();
        let value = value.into();
        match self.index.get(&key) {
            Some(&i) => self.entries[i].1 = value,
            None => {
                self.index.insert(key.clone(), self.entries.len());
                self.entries.push((key, value));
            }
        }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn contains_key(&self, key: &str) -> bool {
        self.index.contains_key(key)
    }

    /// Entries in file order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = (&str, &MetadataValue)> {
        self.entries.iter().map(|(k, v)| (k.as_str(), v))
    }

    pub fn get(&self, key: &str) -> Option<&MetadataValue> {
        self.index.get(key).map(|&i| &self.entries[i].1)
    }

    /// The value of `key`, or [`FormatError::MissingKey`].
    pub fn value(&self, key: &str) -> Result<&MetadataValue, FormatError> {
        self.get(key).ok_or_else(|| FormatError::MissingKey {
            key: key.to_string(),
        })
    }

    /// The value of `key` read as `T`: [`FormatError::MissingKey`] if absent, [`FormatError::WrongType`]
    /// (naming the key and the type found) if it does not convert.
    pub fn get_as<'a, T: FromMetadata<'a>>(&'a self, key: &str) -> Result<T, FormatError> {
        let value = self.value(key)?;
        convert(key, value)
    }

    /// Like [`Metadata::get_as`], but an absent key is `Ok(None)`; a present key of the wrong type is
    /// still an error.
    pub fn get_opt<'a, T: FromMetadata<'a>>(&'a self, key: &str) -> Result<Option<T>, FormatError> {
        self.get(key).map(|value| convert(key, value)).transpose()
    }

    pub fn get_u32(&self, key: &str) -> Result<u32, FormatError> {
        self.get_as(key)
    }

    pub fn get_u64(&self, key: &str) -> Result<u64, FormatError> {
        self.get_as(key)
    }

    pub fn get_i32(&self, key: &str) -> Result<i32, FormatError> {
        self.get_as(key)
    }

    pub fn get_i64(&self, key: &str) -> Result<i64, FormatError> {
        self.get_as(key)
    }

    pub fn get_usize(&self, key: &str) -> Result<usize, FormatError> {
        self.get_as(key)
    }

    pub fn get_f32(&self, key: &str) -> Result<f32, FormatError> {
        self.get_as(key)
    }

    pub fn get_f64(&self, key: &str) -> Result<f64, FormatError> {
        self.get_as(key)
    }

    pub fn get_bool(&self, key: &str) -> Result<bool, FormatError> {
        self.get_as(key)
    }

    pub fn get_str(&self, key: &str) -> Result<&str, FormatError> {
        self.get_as(key)
    }

    pub fn get_array(&self, key: &str) -> Result<&MetadataArray, FormatError> {
        self.get_as(key)
    }

    pub fn get_str_array(&self, key: &str) -> Result<&[String], FormatError> {
        self.get_as(key)
    }

    pub fn get_f32_array(&self, key: &str) -> Result<&[f32], FormatError> {
        self.get_as(key)
    }

    pub fn get_i32_array(&self, key: &str) -> Result<&[i32], FormatError> {
        self.get_as(key)
    }

    pub fn get_u32_array(&self, key: &str) -> Result<&[u32], FormatError> {
        self.get_as(key)
    }

    /// `general.architecture`, the prefix of the model's hyperparameter keys (`llama`, `gemma3`, ...).
    pub fn architecture(&self) -> Result<&str, FormatError> {
        self.get_str("general.architecture")
    }
}

fn convert<'a, T: FromMetadata<'a>>(key: &str, value: &'a MetadataValue) -> Result<T, FormatError> {
    T::from_value(value).ok_or_else(|| FormatError::WrongType {
        key: key.to_string(),
        expected: T::EXPECTED,
        found: describe(value),
    })
}

/// The type found, plus the value itself when it is a scalar (so "u64 (5000000000)" explains why a u32
/// accessor refused it).
fn describe(value: &MetadataValue) -> String {
    match value {
        MetadataValue::String(_) | MetadataValue::Array(_) => value.type_description(),
        MetadataValue::F32(v) => format!("f32 ({v})"),
        MetadataValue::F64(v) => format!("f64 ({v})"),
        MetadataValue::Bool(v) => format!("bool ({v})"),
        other => match other.as_i128() {
            Some(v) => format!("{} ({v})", other.value_type().name()),
            None => other.type_description(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Metadata {
        let mut m = Metadata::new();
        m.insert("a.u32", 7u32).unwrap();
        m.insert("a.u64_small", 9u64).unwrap();
        m.insert("a.u64_big", 5_000_000_000u64).unwrap();
        m.insert("a.neg", -3i32).unwrap();
        m.insert("a.f32", 0.5f32).unwrap();
        m.insert("a.name", "llama").unwrap();
        m.insert("a.tokens", vec!["x".to_string(), "y".to_string()])
            .unwrap();
        m.insert("a.scores", vec![1.0f32, 2.0]).unwrap();
        m
    }

    #[test]
    fn typed_accessors_read_and_widen_integers() {
        let m = sample();
        assert_eq!(m.get_u32("a.u32").unwrap(), 7);
        assert_eq!(m.get_u32("a.u64_small").unwrap(), 9);
        assert_eq!(m.get_u64("a.u32").unwrap(), 7);
        assert_eq!(m.get_i64("a.neg").unwrap(), -3);
        assert_eq!(m.get_f32("a.f32").unwrap(), 0.5);
        assert_eq!(m.get_f64("a.f32").unwrap(), 0.5);
        assert_eq!(m.get_str("a.name").unwrap(), "llama");
        assert_eq!(m.get_str_array("a.tokens").unwrap(), ["x", "y"]);
        assert_eq!(m.get_f32_array("a.scores").unwrap(), [1.0, 2.0]);
        assert_eq!(m.get_opt::<u32>("absent").unwrap(), None);
        assert_eq!(m.get_opt::<u32>("a.u32").unwrap(), Some(7));
    }

    #[test]
    fn errors_name_the_key_and_the_type_found() {
        let m = sample();
        let e = m.get_u32("a.u64_big").unwrap_err().to_string();
        assert!(
            e.contains("a.u64_big") && e.contains("u64 (5000000000)"),
            "{e}"
        );
        let e = m.get_u32("a.neg").unwrap_err().to_string();
        assert!(e.contains("i32 (-3)"), "{e}");
        let e = m.get_str("a.f32").unwrap_err().to_string();
        assert!(
            e.contains("a.f32") && e.contains("f32") && e.contains("expected string"),
            "{e}"
        );
        let e = m.get_f32_array("a.tokens").unwrap_err().to_string();
        assert!(e.contains("array of string"), "{e}");
        let e = m.get_u32("nope").unwrap_err().to_string();
        assert!(e.contains("'nope' not found"), "{e}");
        assert!(m.get_opt::<&str>("a.u32").is_err());
    }

    #[test]
    fn insert_refuses_duplicates_and_set_replaces_in_place() {
        let mut m = sample();
        assert!(m.insert("a.u32", 1u32).is_err());
        m.set("a.u32", 1u8);
        assert_eq!(m.iter().next().unwrap(), ("a.u32", &MetadataValue::U8(1)));
        assert_eq!(m.len(), 8);
    }
}
