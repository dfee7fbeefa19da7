"""What several test modules share: tiny models, engine and server fixtures, kernel batches. No test
module imports another test module; whatever two of them need lives here."""
