"""Vision towers, their attention and the projectors that map image features into a language model."""
