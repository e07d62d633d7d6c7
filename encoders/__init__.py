"""Chorus encoders: vision towers, the Whisper audio encoder, the encoder runner."""
