"""Interop: Hugging Face Marian weights (marian) and model directories in and out (hf), CTranslate2 export."""
