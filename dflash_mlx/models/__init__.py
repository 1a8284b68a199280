"""What to load and how: the registry of pairs (`registry`, models.toml), turning what a
user typed into a choice (`resolve`), the one loader with its CPU dtype rule (`loading`),
the default block size (`block_size`), what a loaded model is made of (`facts`) and how its
chat template is rendered and switches reasoning (`chat_template`: the commands and the server)."""
