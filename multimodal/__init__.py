"""Chorus media loading, processing and encoder-cache bookkeeping (images, audio)."""
