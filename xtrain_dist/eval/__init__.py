"""What a model is measured by: validation loss (evaluate), HellaSwag (hellaswag), and text drawn from it (sample)."""
