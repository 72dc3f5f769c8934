"""Images in prompts (vLLM's `multi_modal_data` and OpenAI image content parts): loading and guarding
images (`images`, `url_guard`), a request's images and limits (`request`), the model directory's image
processor and placeholder expansion (`processor`), the vision encoder's output cache by image content
hash (`encoder_cache`) and the per-step splice of image embeddings into the language model (`step_embeds`)."""
