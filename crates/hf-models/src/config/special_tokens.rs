//! The special tokens a `config.json` names ([`SpecialTokens`]).

use super::*;

/// The token ids generation needs: `eos_token_id` (one id or a list) and `pad_token_id`, from
/// `config.json` and, overriding it, `generation_config.json`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpecialTokens {
    /// Ids that end a sequence.
    pub eos: Vec<u32>,
    /// The padding id, if the checkpoint names one.
    pub pad: Option<u32>,
}

impl SpecialTokens {
    /// The pad id: `pad_token_id`, else the first end-of-sequence id (what transformers'
    /// `generate` falls back to), else 0.
    pub fn pad(&self) -> u32 {
        self.pad.or(self.eos.first().copied()).unwrap_or(0)
    }

    /// Reads the ids of a config file's text over `self` (fields it does not set are kept).
    pub fn update_from_json(&mut self, text: &str) -> Result<(), ConfigError> {
        let value: Value =
            serde_json::from_str(text).map_err(|e| ConfigError::Json(e.to_string()))?;
        let Value::Object(map) = value else {
            return Err(ConfigError::Json("the top level is not an object".into()));
        };
        let fields = Fields(map);
        let id = |value: &Value, field: &str| {
            value
                .as_u64()
                .and_then(|id| u32::try_from(id).ok())
                .ok_or_else(|| fields.type_error(field, "a token id or a list of them", value))
        };
        match fields.get("eos_token_id") {
            Some(Value::Array(ids)) => {
                self.eos = ids
                    .iter()
                    .map(|v| id(v, "eos_token_id"))
                    .collect::<Result<_, _>>()?;
            }
            Some(value) => self.eos = vec![id(value, "eos_token_id")?],
            None => {}
        }
        if let Some(value) = fields.get("pad_token_id") {
            self.pad = Some(id(value, "pad_token_id")?);
        }
        Ok(())
    }
}
