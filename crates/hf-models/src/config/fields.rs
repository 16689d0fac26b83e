//! The JSON reader under every config: typed fields, each error naming its field.

use super::*;

/// A config's fields, `null`s read as absent.
pub(super) struct Fields(pub(super) Map<String, Value>);

impl Fields {
    pub(super) fn get(&self, field: &str) -> Option<&Value> {
        self.0.get(field).filter(|value| !value.is_null())
    }

    pub(super) fn type_error(
        &self,
        field: &str,
        expected: &'static str,
        found: &Value,
    ) -> ConfigError {
        ConfigError::Type {
            field: field.into(),
            expected,
            found: found.to_string(),
        }
    }

    pub(super) fn usize(&self, field: &str) -> Result<Option<usize>, ConfigError> {
        self.get(field)
            .map(|value| {
                value
                    .as_u64()
                    .and_then(|n| usize::try_from(n).ok())
                    .ok_or_else(|| self.type_error(field, "a whole number", value))
            })
            .transpose()
    }

    pub(super) fn required(&self, field: &'static str) -> Result<usize, ConfigError> {
        match self.usize(field)? {
            Some(0) => Err(self.type_error(field, "a positive whole number", &Value::from(0))),
            Some(n) => Ok(n),
            None => Err(ConfigError::Missing(field)),
        }
    }

    pub(super) fn number(&self, field: &str) -> Result<Option<f64>, ConfigError> {
        self.get(field)
            .map(|value| {
                value
                    .as_f64()
                    .ok_or_else(|| self.type_error(field, "a number", value))
            })
            .transpose()
    }

    pub(super) fn positive(&self, field: &str) -> Result<Option<f64>, ConfigError> {
        match self.number(field)? {
            Some(x) if !(x.is_finite() && x > 0.0) => {
                Err(self.type_error(field, "a positive number", &Value::from(x)))
            }
            other => Ok(other),
        }
    }

    /// A soft-cap: `default` when the field is absent, none when it is `null`, else a positive
    /// number that float32 holds as a normal number (a cap the backend's float32 holds as 0 or
    /// infinity would make the logits NaN).
    pub(super) fn softcap(
        &self,
        field: &str,
        default: Option<f64>,
    ) -> Result<Option<f64>, ConfigError> {
        if !self.0.contains_key(field) {
            return Ok(default);
        }
        match self.positive(field)? {
            Some(cap) if !(cap as f32).is_normal() => Err(self.type_error(
                field,
                "a positive number within float32's normal range",
                &Value::from(cap),
            )),
            cap => Ok(cap),
        }
    }

    pub(super) fn bool(&self, field: &str) -> Result<Option<bool>, ConfigError> {
        self.get(field)
            .map(|value| {
                value
                    .as_bool()
                    .ok_or_else(|| self.type_error(field, "true or false", value))
            })
            .transpose()
    }

    pub(super) fn string(&self, field: &str) -> Result<Option<String>, ConfigError> {
        self.get(field)
            .map(|value| {
                value
                    .as_str()
                    .map(str::to_string)
                    .ok_or_else(|| self.type_error(field, "a string", value))
            })
            .transpose()
    }

    /// Errors when `field` is present with a value other than `supported`.
    pub(super) fn require_eq(
        &self,
        field: &str,
        supported: bool,
        what: &'static str,
    ) -> Result<(), ConfigError> {
        match self.bool(field)? {
            Some(value) if value != supported => Err(ConfigError::Unsupported {
                field: field.into(),
                value: value.to_string(),
                supported: what,
            }),
            _ => Ok(()),
        }
    }
}
