"""Hugging Face checkpoint -> GGUF conversion (text model + mmproj), llama.cpp conventions."""
