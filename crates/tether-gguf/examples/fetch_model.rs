//! Fetches the default model into the user's cache (what `scripts/test` runs before the tests);
//! prints its path. Does nothing but check the size when it is already cached.

fn main() -> std::process::ExitCode {
    match tether_gguf::fetch::default_model() {
        Ok(p) => {
            println!("{}", p.display());
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("tether: {e}");
            std::process::ExitCode::from(2)
        }
    }
}
