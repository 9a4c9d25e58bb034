"""Images in (docs/server.md "Images"): vision-language targets through mlx-vlm, an optional
extra (``pip install -e ".[vision]"``) imported only when a VLM is loaded or an image sent."""
