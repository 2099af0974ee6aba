//! Naga validation of generated WGSL: every source is parsed and validated
//! before a pipeline is created from it, so a codegen bug surfaces as a
//! `BackendError::Compile` carrying the source instead of a driver crash.

use naga::valid::{Capabilities, ValidationFlags, Validator};

/// Parses and validates `source`; the error message includes the
/// diagnostic with its location.
pub fn validate_wgsl(source: &str) -> Result<(), String> {
    let module = naga::front::wgsl::parse_str(source).map_err(|e| e.emit_to_string(source))?;
    Validator::new(ValidationFlags::all(), Capabilities::empty())
        .validate(&module)
        .map(|_| ())
        .map_err(|e| e.emit_to_string(source))
}
