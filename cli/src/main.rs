//! `accelerate-rs`: the command-line front end. Everything happens in [`accelerate_rs_cli::main`].

fn main() -> std::process::ExitCode {
    accelerate_rs_cli::main()
}
