"""What to load and how: the registry of pairs (`registry`, models.toml), turning what a
user typed into a choice (`resolve`), the one loader with its CPU dtype rule (`loading`),
the default block size (`block_size`) and what a loaded model is made of (`facts`)."""
