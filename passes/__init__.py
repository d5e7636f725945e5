"""FX passes that rewrite DeepSeek-V4's hot spots to the dsv4 ops in inductor's post-grad graph."""
