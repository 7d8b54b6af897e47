//! TinyGPT models.
