//! A guard around a serde deserializer of peer bytes (see
//! [`Postcard`](crate::Postcard)): it passes every call through, and adds
//! two bounds the format itself does not keep.
//!
//! * **Nesting depth**: a value of a recursive type (a tree, a JSON-like
//!   value) nested [`MAX_DEPTH`] levels deep is refused. Decoding recurses
//!   once per level, a byte or two of input each: unbounded, a spilled
//!   input of a few MiB overflowed the stack of the thread that decoded
//!   it, which aborts the whole process.
//! * **Length hints**: a sequence's or map's claimed length is passed on
//!   as at most the input's length (an element takes at least a byte).
//!   Serde preallocates up to its hint (at most 1 MiB per container), and
//!   postcard passes a map's claimed length as it is: four bytes of input
//!   made a 2 MiB allocation, once per nesting level.
//! * **Elements**: a decode takes at most the input's length plus
//!   [`ZERO_SIZED_ALLOWANCE`] elements of sequences and maps in all. Every
//!   element but a zero-sized one (`()`, a unit struct) takes a byte at
//!   least, so only collections of those can reach it: unbounded, a
//!   `Vec<()>` that claimed 2^63 elements in ten bytes kept the decoder
//!   busy for ever.
//!
//! Found by the fuzz target `rpc_codec` (`fuzz/`).

use std::cell::Cell;
use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, Visitor};

/// The deepest nesting of containers (sequences, maps, options, enum
/// variants, newtypes) a decoded value may have: as serde_json's default.
pub const MAX_DEPTH: usize = 128;

/// Elements of sequences and maps a decode may take beyond one per input
/// byte: what collections of zero-sized values may hold in all.
pub const ZERO_SIZED_ALLOWANCE: usize = 1 << 16;

// The message below names the bound.
const _: () = assert!(MAX_DEPTH == 128);
/// Why a guard refuses a value nested too deep.
const TOO_DEEP: &str = "nested deeper than 128 levels (hg_rpc::codec::MAX_DEPTH)";
/// Why a guard refuses an input with too many elements.
const TOO_MANY: &str = "more collection elements than the input has bytes (collections of zero-sized values)";

/// What one decode shares among its guards: the elements it may still
/// take, and why a guard refused the input (the format's own error type
/// may drop the message: postcard's does).
pub(crate) struct Budget {
    elements: Cell<usize>,
    refused: Cell<Option<&'static str>>,
}

impl Budget {
    /// The budget of an input of `len` bytes.
    pub(crate) fn for_input(len: usize) -> Self {
        Budget {
            elements: Cell::new(len.saturating_add(ZERO_SIZED_ALLOWANCE)),
            refused: Cell::new(None),
        }
    }

    /// Why a guard refused the input, if one did.
    pub(crate) fn refused(&self) -> Option<&'static str> {
        self.refused.get()
    }

    fn refuse<E: de::Error>(&self, why: &'static str) -> E {
        self.refused.set(Some(why));
        E::custom(why)
    }
}

/// The bounds of one value being decoded: its depth, the largest length
/// hint passed on, and the decode's budget.
#[derive(Clone, Copy)]
struct Limits<'b> {
    depth: usize,
    max_hint: usize,
    budget: &'b Budget,
}

impl Limits<'_> {
    fn deeper<E: de::Error>(self) -> Result<Self, E> {
        if self.depth >= MAX_DEPTH {
            return Err(self.budget.refuse(TOO_DEEP));
        }
        Ok(Limits {
            depth: self.depth + 1,
            ..self
        })
    }

    /// Takes one element from the budget.
    fn element<E: de::Error>(self) -> Result<(), E> {
        match self.budget.elements.get().checked_sub(1) {
            Some(left) => {
                self.budget.elements.set(left);
                Ok(())
            }
            None => Err(self.budget.refuse(TOO_MANY)),
        }
    }

    fn hint(self, hint: Option<usize>) -> Option<usize> {
        hint.map(|n| n.min(self.max_hint))
    }
}

/// A deserializer whose nested values are guarded too.
pub(crate) struct Guard<'b, D> {
    inner: D,
    lim: Limits<'b>,
}

/// Passes `deserialize_*` calls to the inner deserializer with a guarded visitor.
macro_rules! forward {
    ($($method:ident($($arg:ident: $ty:ty),*)),* $(,)?) => {$(
        fn $method<V: Visitor<'de>>(self, $($arg: $ty,)* visitor: V) -> Result<V::Value, D::Error> {
            self.inner.$method($($arg,)* Guarded { inner: visitor, lim: self.lim })
        }
    )*};
}

impl<'de, D: Deserializer<'de>> Deserializer<'de> for Guard<'_, D> {
    type Error = D::Error;

    forward! {
        deserialize_any(), deserialize_bool(), deserialize_i8(), deserialize_i16(), deserialize_i32(),
        deserialize_i64(), deserialize_i128(), deserialize_u8(), deserialize_u16(), deserialize_u32(),
        deserialize_u64(), deserialize_u128(), deserialize_f32(), deserialize_f64(), deserialize_char(),
        deserialize_str(), deserialize_string(), deserialize_bytes(), deserialize_byte_buf(),
        deserialize_option(), deserialize_unit(), deserialize_unit_struct(name: &'static str),
        deserialize_newtype_struct(name: &'static str), deserialize_seq(),
        deserialize_tuple(len: usize), deserialize_tuple_struct(name: &'static str, len: usize),
        deserialize_map(), deserialize_struct(name: &'static str, fields: &'static [&'static str]),
        deserialize_enum(name: &'static str, variants: &'static [&'static str]),
        deserialize_identifier(), deserialize_ignored_any(),
    }

    fn is_human_readable(&self) -> bool {
        self.inner.is_human_readable()
    }
}

/// A visitor that guards what it is handed to go deeper with.
struct Guarded<'b, V> {
    inner: V,
    lim: Limits<'b>,
}

/// Passes `visit_*` calls of plain values to the inner visitor.
macro_rules! plain {
    ($($method:ident($ty:ty)),* $(,)?) => {$(
        fn $method<E: de::Error>(self, v: $ty) -> Result<Self::Value, E> {
            self.inner.$method(v)
        }
    )*};
}

impl<'de, V: Visitor<'de>> Visitor<'de> for Guarded<'_, V> {
    type Value = V::Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.inner.expecting(f)
    }

    plain! {
        visit_bool(bool), visit_i8(i8), visit_i16(i16), visit_i32(i32), visit_i64(i64), visit_i128(i128),
        visit_u8(u8), visit_u16(u16), visit_u32(u32), visit_u64(u64), visit_u128(u128), visit_f32(f32),
        visit_f64(f64), visit_char(char), visit_str(&str), visit_borrowed_str(&'de str), visit_string(String),
        visit_bytes(&[u8]), visit_borrowed_bytes(&'de [u8]), visit_byte_buf(Vec<u8>),
    }

    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        self.inner.visit_none()
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        self.inner.visit_unit()
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        let lim = self.lim.deeper()?;
        self.inner.visit_some(Guard { inner: d, lim })
    }

    fn visit_newtype_struct<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        let lim = self.lim.deeper()?;
        self.inner.visit_newtype_struct(Guard { inner: d, lim })
    }

    fn visit_seq<A: de::SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
        let lim = self.lim.deeper()?;
        self.inner.visit_seq(Access { inner: seq, lim })
    }

    fn visit_map<A: de::MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        let lim = self.lim.deeper()?;
        self.inner.visit_map(Access { inner: map, lim })
    }

    fn visit_enum<A: de::EnumAccess<'de>>(self, data: A) -> Result<Self::Value, A::Error> {
        let lim = self.lim.deeper()?;
        self.inner.visit_enum(Access { inner: data, lim })
    }
}

/// A seed whose value is decoded through a guard.
struct Seed<'b, S> {
    inner: S,
    lim: Limits<'b>,
}

impl<'de, S: DeserializeSeed<'de>> DeserializeSeed<'de> for Seed<'_, S> {
    type Value = S::Value;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<S::Value, D::Error> {
        self.inner.deserialize(Guard {
            inner: d,
            lim: self.lim,
        })
    }
}

/// A sequence's, map's, enum's or variant's access, guarded (at the
/// depth of its elements).
struct Access<'b, A> {
    inner: A,
    lim: Limits<'b>,
}

impl<'de, A: de::SeqAccess<'de>> de::SeqAccess<'de> for Access<'_, A> {
    type Error = A::Error;

    fn next_element_seed<T: DeserializeSeed<'de>>(&mut self, seed: T) -> Result<Option<T::Value>, A::Error> {
        let v = self.inner.next_element_seed(Seed {
            inner: seed,
            lim: self.lim,
        })?;
        if v.is_some() {
            self.lim.element()?;
        }
        Ok(v)
    }

    fn size_hint(&self) -> Option<usize> {
        self.lim.hint(self.inner.size_hint())
    }
}

impl<'de, A: de::MapAccess<'de>> de::MapAccess<'de> for Access<'_, A> {
    type Error = A::Error;

    fn next_key_seed<K: DeserializeSeed<'de>>(&mut self, seed: K) -> Result<Option<K::Value>, A::Error> {
        let k = self.inner.next_key_seed(Seed {
            inner: seed,
            lim: self.lim,
        })?;
        if k.is_some() {
            self.lim.element()?;
        }
        Ok(k)
    }

    fn next_value_seed<T: DeserializeSeed<'de>>(&mut self, seed: T) -> Result<T::Value, A::Error> {
        self.inner.next_value_seed(Seed {
            inner: seed,
            lim: self.lim,
        })
    }

    fn size_hint(&self) -> Option<usize> {
        self.lim.hint(self.inner.size_hint())
    }
}

impl<'b, 'de, A: de::EnumAccess<'de>> de::EnumAccess<'de> for Access<'b, A> {
    type Error = A::Error;
    type Variant = Access<'b, A::Variant>;

    fn variant_seed<T: DeserializeSeed<'de>>(self, seed: T) -> Result<(T::Value, Self::Variant), A::Error> {
        let lim = self.lim;
        let (v, variant) = self.inner.variant_seed(Seed { inner: seed, lim })?;
        Ok((v, Access { inner: variant, lim }))
    }
}

impl<'de, A: de::VariantAccess<'de>> de::VariantAccess<'de> for Access<'_, A> {
    type Error = A::Error;

    fn unit_variant(self) -> Result<(), A::Error> {
        self.inner.unit_variant()
    }

    fn newtype_variant_seed<T: DeserializeSeed<'de>>(self, seed: T) -> Result<T::Value, A::Error> {
        self.inner.newtype_variant_seed(Seed {
            inner: seed,
            lim: self.lim,
        })
    }

    fn tuple_variant<V: Visitor<'de>>(self, len: usize, visitor: V) -> Result<V::Value, A::Error> {
        self.inner.tuple_variant(
            len,
            Guarded {
                inner: visitor,
                lim: self.lim,
            },
        )
    }

    fn struct_variant<V: Visitor<'de>>(
        self,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, A::Error> {
        self.inner.struct_variant(
            fields,
            Guarded {
                inner: visitor,
                lim: self.lim,
            },
        )
    }
}

/// Decodes a `T` through a guard on `d`, an input of `len` bytes, with
/// `budget` (made for that input).
pub(crate) fn decode<'de, T: de::Deserialize<'de>, D: Deserializer<'de>>(
    d: D,
    len: usize,
    budget: &Budget,
) -> Result<T, D::Error> {
    let lim = Limits {
        depth: 0,
        max_hint: len,
        budget,
    };
    T::deserialize(Guard { inner: d, lim })
}
