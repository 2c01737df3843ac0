"""Training plumbing the methods share: the non-finite guard, Hugging Face export, checkpoint IO and resume."""
