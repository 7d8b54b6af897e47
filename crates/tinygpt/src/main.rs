//! The `tinygpt` binary (the command line lives in the library: src/lib.rs).

fn main() {
    tinygpt::main()
}
