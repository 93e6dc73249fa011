"""Coverage-guided fuzz targets (atheris) for the GGUF reader and the chat template renderer."""
