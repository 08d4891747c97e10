//! `accelerate-rs`: the command-line front end. Everything happens in [`accelerate_rs::cli`].

fn main() -> std::process::ExitCode {
    accelerate_rs::cli::main()
}
