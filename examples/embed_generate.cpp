// A C++ host running swiftk's Python engine in an embedded interpreter (pybind11::scoped_interpreter): load a model,
// stream `generate` through a C++ callback that prints each text piece as it comes.
//
// Usage: embed_generate MODEL [PROMPT] [MAX_NEW_TOKENS]   (MODEL: registry name, .gguf path or HF directory)
// The interpreter starts as $SWIFTK_PYTHON, else as the Python CMake was configured with (SWIFTK_DEFAULT_PYTHON):
// starting as a venv's python makes Python find its pyvenv.cfg, so that venv's site-packages (swiftk, torch) are
// importable exactly as in `python -c "import swiftk"`, with no PYTHONPATH/PYTHONHOME to keep in sync.
// Output: the streamed pieces, then "\n=== swiftk result: <n> pieces ===\n<returned text>\n=== end ===\n".
#include <pybind11/embed.h>

#include <stdio.h>
#include <stdlib.h>

#include <string>

namespace py = pybind11;

#ifndef SWIFTK_DEFAULT_PYTHON
#define SWIFTK_DEFAULT_PYTHON ""
#endif

int main(int argc, char** argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s MODEL [PROMPT] [MAX_NEW_TOKENS]\n", argv[0]);
    return 2;
  }
  const std::string model = argv[1];
  const std::string prompt = argc > 2 ? argv[2] : "Once upon a time";
  const int max_new = argc > 3 ? atoi(argv[3]) : 32;
  const char* env = getenv("SWIFTK_PYTHON");
  const std::string python = env && *env ? env : SWIFTK_DEFAULT_PYTHON;

  PyConfig config;
  PyConfig_InitPythonConfig(&config);
  config.parse_argv = 0;   // our argv is not Python's
  if (!python.empty()) {
    PyStatus s = PyConfig_SetBytesString(&config, &config.program_name, python.c_str());
    if (PyStatus_Exception(s)) {
      PyConfig_Clear(&config);
      fprintf(stderr, "embed_generate: bad interpreter path %s\n", python.c_str());
      return 2;
    }
  }
  py::scoped_interpreter guard(&config);   // takes and clears config

  try {
    py::module_ swiftk = py::module_::import("swiftk");
    py::object eng = swiftk.attr("load")(model);

    int pieces = 0;
    // Called by the engine on the interpreter's thread with each decoded piece; the GIL is held.
    auto on_piece = [&pieces](const std::string& piece) {
      fwrite(piece.data(), 1, piece.size(), stdout);
      fflush(stdout);
      pieces++;
    };
    py::object result = eng.attr("generate")(prompt, py::arg("max_new_tokens") = max_new,
                                             py::arg("callback") = py::cpp_function(on_piece));
    const std::string text = result.attr("text").cast<std::string>();
    printf("\n=== swiftk result: %d pieces ===\n%s\n=== end ===\n", pieces, text.c_str());
    fflush(stdout);
  } catch (const py::error_already_set& e) {   // a Python exception: its type and message
    fprintf(stderr, "embed_generate: %s\n", e.what());
    return 1;
  }
  return 0;
}
