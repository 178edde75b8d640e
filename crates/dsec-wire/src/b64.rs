//! [`Base64Bytes`]: bytes that travel in JSON as one standard base64 string.

use base64::Engine as _;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Bytes carried in JSON as a standard (padded) base64 string: file contents, stdin and
/// output of function calls, whatever they hold.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Base64Bytes(pub Vec<u8>);

impl Base64Bytes {
    /// The bytes as (lossy) UTF-8 text.
    pub fn to_text(&self) -> String {
        String::from_utf8_lossy(&self.0).into_owned()
    }

    /// Number of bytes.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether there are no bytes.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl std::fmt::Debug for Base64Bytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Base64Bytes({} bytes)", self.0.len())
    }
}

impl From<Vec<u8>> for Base64Bytes {
    fn from(v: Vec<u8>) -> Self {
        Self(v)
    }
}

impl From<&str> for Base64Bytes {
    fn from(s: &str) -> Self {
        Self(s.as_bytes().to_vec())
    }
}

impl Serialize for Base64Bytes {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&base64::engine::general_purpose::STANDARD.encode(&self.0))
    }
}

impl<'de> Deserialize<'de> for Base64Bytes {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        base64::engine::general_purpose::STANDARD
            .decode(text.trim())
            .map(Self)
            .map_err(|e| serde::de::Error::custom(format!("invalid base64: {e}")))
    }
}

#[cfg(feature = "schema")]
impl schemars::JsonSchema for Base64Bytes {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "Base64Bytes".into()
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "type": "string",
            "contentEncoding": "base64",
            "description": "Bytes, base64-encoded (standard alphabet, padded)."
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_any_bytes_and_refuses_bad_text() {
        let b = Base64Bytes(vec![0, 255, b'a']);
        let json = serde_json::to_string(&b).expect("ser");
        assert_eq!(json, "\"AP9h\"");
        assert_eq!(serde_json::from_str::<Base64Bytes>(&json).expect("de"), b);
        let err = serde_json::from_str::<Base64Bytes>("\"%%%\"").expect_err("bad");
        assert!(err.to_string().contains("invalid base64"), "{err}");
    }
}
